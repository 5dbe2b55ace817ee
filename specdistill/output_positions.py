"""Acceptance by where in the output a speculative round starts: buckets of output position (tokens generated before
the round), counted per row from a rollout's RoundRecords. One function serves the evaluator's report
(specdistill.eval.metrics) and Draft-OPD's rollout metrics (specdistill.onpolicy); it knows nothing of either, only of
decoding's RoundRecord.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specdistill.decoding import RoundRecord

# Output positions (tokens generated before a round) where each bucket starts: long outputs get wide buckets.
DEFAULT_POSITION_BUCKETS = (0, 128, 256, 512, 1024)


def check_position_buckets(starts: Sequence[int], name: str = "eval.position_buckets") -> None:
    """Bucket starts must be increasing integers from 0 (each bucket runs to the next start; the last is open)."""
    starts = list(starts)
    if not starts or starts[0] != 0 or any(not isinstance(x, int) or isinstance(x, bool) for x in starts) or any(
            b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"{name}={starts} must list bucket starts as increasing integers beginning at 0, e.g. "
                         f"{list(DEFAULT_POSITION_BUCKETS)} (buckets 0-127, 128-255, 256-511, 512-1023, 1024+)")


def bucket_name(start: int, end: Optional[int]) -> str:
    """"0_127" for [0, 128), "1024_plus" for the open last bucket: usable in metric names."""
    return f"{start}_plus" if end is None else f"{start}_{end - 1}"


def bucket_label(start: int, end: Optional[int]) -> str:
    """"0-127", "1024+": for tables and plots."""
    return f"{start}+" if end is None else f"{start}-{end - 1}"


@dataclass
class BucketCounts:
    """One bucket of output positions [start, end) (end None: no upper bound), per row: the row-rounds that started
    there (offset = tokens the row had generated before the round) and what they proposed, accepted and emitted."""
    start: int
    end: Optional[int]
    rounds: torch.Tensor    # (B,) long, row-rounds (target forwards) that started in the bucket
    tokens: torch.Tensor    # (B,) long, tokens those rounds emitted (accepted drafts + correction/bonus, cut at EOS)
    proposed: torch.Tensor  # (B,) long, drafts they proposed (gamma of each round)
    accepted: torch.Tensor  # (B,) long, drafts the verifier accepted

    @property
    def name(self) -> str:
        return bucket_name(self.start, self.end)

    @property
    def label(self) -> str:
        return bucket_label(self.start, self.end)


def output_position_buckets(rounds: Sequence[RoundRecord], starts: Sequence[int] = DEFAULT_POSITION_BUCKETS,
                            ) -> list[BucketCounts]:
    """A rollout's rounds -> per-bucket, per-row counts, one BucketCounts per bucket start (empty buckets included).

    A round belongs to the bucket of the output position where it starts (RoundRecord.offset); only active rows count.
    Worked example, starts (0, 4), one row, gamma 2: rounds at offsets 0, 3, 5 accepting 2, 0, 1 drafts ->
    bucket 0-3: rounds 2, proposed 4, accepted 2; bucket 4+: rounds 1, proposed 2, accepted 1.
    """
    check_position_buckets(starts, "position bucket starts")
    ends = list(starts[1:]) + [None]
    if not rounds:
        return [BucketCounts(s, e, *torch.zeros(4, 0, dtype=torch.long)) for s, e in zip(starts, ends)]
    # every round's per-row values at once: one host transfer each, not one per round; a round that ran fewer rows
    # (drop_finished_rows) counts as inactive in the others. A call's first round runs all its B rows.
    B = rounds[0].active.shape[0]

    def stacked(name: str) -> torch.Tensor:
        return torch.stack([r.on_rows(getattr(r, name), B) for r in rounds]).cpu().long()  # (R, B)

    active = stacked("active")                                                      # (R, B)
    offset = stacked("offset")                                                      # (R, B)
    emitted = stacked("num_emitted") * active                                       # (R, B)
    accepted = stacked("num_accepted") * active                                     # (R, B)
    proposed = torch.tensor([r.gamma for r in rounds])[:, None] * active            # (R, B)
    which = torch.searchsorted(torch.tensor(list(starts)), offset, right=True) - 1  # (R, B) bucket of the round start
    inside = torch.nn.functional.one_hot(which, len(starts)) * active[..., None]    # (R, B, NB)
    sums = [(inside * x[..., None]).sum(0).T for x in (torch.ones_like(active), emitted, proposed, accepted)]  # (NB, B)
    return [BucketCounts(s, e, *(x[i] for x in sums)) for i, (s, e) in enumerate(zip(starts, ends))]
