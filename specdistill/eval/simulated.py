"""Simulated acceptance during training: teacher-forced agreement runs between draft and target (a fast proxy).

At each held-out loss position t, the draft "agrees" if its argmax equals the target's argmax. A chain started at
t is accepted for k steps if positions t..t+k-1 all agree (and are loss positions). Then
a_k = #chains reaching k / #chains reaching k-1 and tau_sim = 1 + sum_k prod_{i<=k} a_i (capped at gamma).
This ignores that at inference the draft conditions on its own tokens; the real number is scripts/evaluate.py's.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from specdistill.drafts import draft_adapter
from specdistill.drafts.base import chain_counts  # noqa: F401  (re-exported: the pure counter)


@dataclass
class SimulatedAcceptance:
    gamma: int
    accept_rate_per_pos: list[float]  # a_k, k = 1..gamma
    mean_accept_len: float  # tau_sim = 1 + sum_k prod_{i<=k} a_i
    top1_agreement: float  # a_1: share of loss positions where draft argmax == target argmax
    num_positions: int

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(reached: torch.Tensor, gamma: int) -> SimulatedAcceptance:
    reached = reached.double().cpu()
    n0 = max(reached[0].item(), 1.0)
    rates = [(reached[k] / reached[k - 1]).item() if reached[k - 1] > 0 else 0.0 for k in range(1, gamma + 1)]
    tau = 1.0 + (reached[1:] / n0).sum().item()
    return SimulatedAcceptance(gamma, rates, tau, rates[0] if rates else 0.0, int(reached[0].item()))


@torch.no_grad()
def simulated_acceptance(draft, target, batches, gamma: int, reduce=lambda t: t) -> SimulatedAcceptance:
    """batches: iterable of collated dicts on the right device. `reduce` sums tensors over ranks.
    Works for every draft kind: the draft's adapter (drafts/) counts the chains."""
    was_training = draft.training
    draft.eval()
    adapter = draft_adapter(draft)
    total = None
    for batch in batches:
        p = target(batch["input_ids"], batch["attention_mask"])
        counts = adapter.chain_counts(p, batch, gamma)  # (K+1,): K <= gamma, the drafts the kind can make
        total = counts if total is None else total + counts
    draft.train(was_training)
    if total is None:
        return SimulatedAcceptance(gamma, [0.0] * gamma, 1.0, 0.0, 0)
    return summarize(reduce(total), len(total) - 1)
