"""Drafted positions (Draft-OPD, arXiv 2605.29343): the containers a rollout fills, and their assembly from the
RoundRecords of a recorded speculative rollout. Knows nothing of drafts or objectives; see onpolicy/rollout.py for
the categories and the row layout."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


ACCEPTED, FIRST_REJECTED, AFTER_REJECTION = 0, 1, 2
CATEGORIES = ("accepted", "first_rejected", "after_rejection")


# ----------------------------------------------------------------------------------------------- containers
@dataclass
class TargetLogits:
    """The target's distribution at P positions: full raw logits (P, V), or its top-k (values, ids (P, k))."""

    values: torch.Tensor                   # (P, V) or (P, k)
    indices: Optional[torch.Tensor] = None  # (P, k) long, None = full
    vocab: int = 0

    @classmethod
    def from_logits(cls, logits: torch.Tensor, top_k: int = 0) -> "TargetLogits":
        V = logits.shape[-1]
        if top_k and top_k < V:
            values, indices = logits.float().topk(top_k, dim=-1)
            return cls(values, indices, V)
        return cls(logits.float(), None, V)

    def __len__(self) -> int:
        return self.values.shape[0]

    def select(self, idx: torch.Tensor) -> "TargetLogits":
        return TargetLogits(self.values[idx], None if self.indices is None else self.indices[idx], self.vocab)

    def to(self, device) -> "TargetLogits":
        return TargetLogits(self.values.to(device), None if self.indices is None else self.indices.to(device),
                            self.vocab)

    def dense(self) -> torch.Tensor:
        """(P, V) logits. Top-k: the tail sits 20 nats under the k-th logit (~e^-20 each, finite so that reverse KL
        and JSD stay finite): p is the top-k renormalised, to within V * e^-20."""
        if self.indices is None:
            return self.values
        floor = self.values.min(-1, keepdim=True).values - 20.0            # (P, 1)
        out = floor.expand(-1, self.vocab).clone()
        return out.scatter_(1, self.indices, self.values)

    @staticmethod
    def cat(parts: list["TargetLogits"]) -> "TargetLogits":
        if any((p.indices is None) != (parts[0].indices is None) for p in parts):
            raise ValueError("cannot mix full and top-k target logits")
        idx = None if parts[0].indices is None else torch.cat([p.indices for p in parts])
        return TargetLogits(torch.cat([p.values for p in parts]), idx, parts[0].vocab)


@dataclass
class RolloutStats:
    """Sums over one rollout batch (ratios are taken from sums)."""

    rows: int = 0
    new_tokens: int = 0          # tokens generated
    target_forwards: int = 0     # row-rounds (assist) or simulated blocks (no assist)
    emitted: int = 0             # tokens those rounds emit (accepted drafts + the correction or bonus): tau = emitted
    #                              / target_forwards; = new_tokens with assist, what speculation would emit without
    drafted: int = 0             # drafted positions verified
    accepted: int = 0            # of them accepted by the verifier
    alpha: float = 0.0           # sum of sum_x min(p, q) over drafted positions (rollout temperature)
    target_tokens: int = 0       # tokens the target ran a forward over (prefill + verification, real rows only)
    # the rounds by where in the output each started: output_positions.BucketCounts per bucket (assisted rollouts)
    output_buckets: list = field(default_factory=list)


@dataclass
class DraftedPositions:
    """P drafted positions with their contexts in R token rows (1-D, unpadded)."""

    rows: list[torch.Tensor]     # R x (L_r,) long
    row: torch.Tensor            # (P,) which row holds the context
    context_len: torch.Tensor    # (P,) the context is rows[row][:context_len]; the draft predicts the next token
    token: torch.Tensor          # (P,) the drafted token
    target: TargetLogits         # (P, V) the target's raw logits at the position
    category: torch.Tensor       # (P,) ACCEPTED | FIRST_REJECTED | AFTER_REJECTION
    accepted: torch.Tensor       # (P,) bool, the verifier's decision (== category ACCEPTED)
    round_id: torch.Tensor       # (P,) one id per (round, row); positions of a round are contiguous, by index
    index: torch.Tensor          # (P,) 0-based draft position within the round
    alpha: torch.Tensor          # (P,) sum_x min(p, q) at the rollout's temperature (0/1 at temperature 0)
    stats: RolloutStats = field(default_factory=RolloutStats)
    source: Optional[list[int]] = None   # R: the trajectory each row comes from (a branch: its round's row)
    aux: Optional[torch.Tensor] = None   # EAGLE-3 heads: (R, L, n_aux * Ht) the target's aux hidden states per row
    # token-tree rollouts (onpolicy/tree_positions.py): each position's parent position (-1 at a round's root) and
    # the probability that verification moves from it to this context's node; None for chains
    parent: Optional[torch.Tensor] = None  # (P,) long
    edge: Optional[torch.Tensor] = None    # (P,) float

    def __len__(self) -> int:
        return self.row.shape[0]

    def contexts(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """The context token rows of positions idx (each (context_len,))."""
        return [self.rows[int(r)][: int(n)] for r, n in zip(self.row[idx].tolist(), self.context_len[idx].tolist())]


def trajectories(prompt_ids, prompt_mask, sequences, num_new) -> list[torch.Tensor]:
    return [torch.cat([prompt_ids[b][prompt_mask[b].bool()], sequences[b, : int(num_new[b])]])
            for b in range(prompt_ids.shape[0])]


def row_features(hidden: torch.Tensor, prompt_mask: torch.Tensor, rows: list[torch.Tensor],
                 source: list[int]) -> torch.Tensor:
    """Rollout.hidden (B, T-1+N, D), column c = token c of [left-padded prompt (B, T), generated tokens], -> (R, L, D)
    per context row, right-aligned to the unpadded rows: trajectory b's token t at slot t; a branch row gets its
    source trajectory's features (it shares that trajectory's tokens up to its round's accepted drafts, the only
    slots read there). Slots without a feature (a trajectory's last token, past its end) are zero."""
    B, C, D = hidden.shape
    L = max(len(r) for r in rows)
    pad = prompt_mask.shape[1] - prompt_mask.long().sum(1)                  # (B,) left padding of each prompt
    col = pad.to(hidden.device)[:, None] + torch.arange(L, device=hidden.device)  # (B, L) column of token t
    feats = hidden.gather(1, col.clamp(max=C - 1)[..., None].expand(B, L, D)) * (col < C)[..., None]  # (B, L, D)
    return feats[torch.tensor(source, device=hidden.device)]                # (R, L, D)


# ----------------------------------------------------------------------------------------------- assisted
def positions_from_rounds(prompt_ids, prompt_mask, rollout, top_k: int, branches: bool) -> DraftedPositions:
    """Turn the RoundRecords of a recorded speculative rollout into drafted positions."""
    B = prompt_ids.shape[0]
    device = prompt_ids.device
    trajs = trajectories(prompt_ids, prompt_mask, rollout.sequences.to(device), rollout.num_new_tokens.to(device))
    rows, source = list(trajs), list(range(B))
    plen = prompt_mask.long().sum(1)                                         # (B,)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("row", "ctx", "tok", "cat", "acc", "rid", "idx", "alpha")}
    targets: list[TargetLogits] = []
    n_new = int(rollout.num_new_tokens.sum())
    stats = RolloutStats(rows=B, new_tokens=n_new, emitted=n_new, target_forwards=int(rollout.target_forwards.sum()),
                         target_tokens=int((plen - 1).sum()))                # the prefill feeds prompt[:-1]
    rid = 0
    for rnd in rollout.rounds:
        K = rnd.gamma
        active = rnd.active.to(device)
        stats.target_tokens += int(active.sum()) * (K + 1)
        if K == 0:
            continue
        n, count = rnd.num_accepted.to(device), rnd.num_emitted.to(device)   # (B,)
        i = torch.arange(K, device=device).expand(B, K)                      # (B, K)
        category = torch.where(i < n[:, None], ACCEPTED, torch.where(i == n[:, None], FIRST_REJECTED, AFTER_REJECTION))
        # On the trajectory: contexts within what the round emitted (drafts past an EOS inside the accepted run are
        # dropped). After a rejection: kept when the whole accepted run + correction was emitted.
        on_traj = i < count[:, None]
        off_traj = (i > n[:, None]) & (count == n + 1)[:, None]
        keep = active[:, None] & (on_traj | (off_traj & branches))          # (B, K)
        stats.drafted += int((active[:, None] & (i <= n[:, None])).sum())   # what the verifier decided on
        stats.accepted += int((rnd.accepted.to(device) & active[:, None]).sum())
        stats.alpha += float((rnd.alpha.to(device) * (active[:, None] & (i <= n[:, None]))).sum())
        base = plen + rnd.offset.to(device)                                  # (B,) context length at draft 0
        row = torch.arange(B, device=device)[:, None].expand(B, K).clone()  # (B, K)
        drafts = rnd.draft_tokens.to(device)
        for b in (keep & off_traj).any(1).nonzero().flatten().tolist():     # one branch row per such round
            nb, start = int(n[b]), int(base[b])
            row[b, nb + 1:] = len(rows)
            rows.append(torch.cat([trajs[b][: start + nb], drafts[b, nb: K - 1]]))
            source.append(b)
        sel = keep.nonzero(as_tuple=True)                                    # row-major: rounds contiguous, by index
        parts["row"].append(row[sel])
        parts["ctx"].append((base[:, None] + i)[sel])
        parts["tok"].append(drafts[sel])
        parts["cat"].append(category[sel])
        parts["acc"].append(rnd.accepted.to(device)[sel])
        parts["rid"].append((rid + torch.arange(B, device=device)[:, None].expand(B, K))[sel])
        parts["idx"].append(i[sel])
        parts["alpha"].append(rnd.alpha.to(device).float()[sel])
        targets.append(TargetLogits.from_logits(rnd.target_logits[:, :K].to(device)[sel], top_k))
        rid += B
    out = assemble_positions(rows, parts, targets, stats)
    out.source = source
    return out


def assemble_positions(rows, parts, targets, stats) -> DraftedPositions:
    device = rows[0].device
    if not targets:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return DraftedPositions(rows, empty, empty, empty, TargetLogits(torch.zeros(0, 1, device=device)), empty,
                                empty.bool(), empty, empty, empty.float(), stats)
    cat = {k: torch.cat(v) for k, v in parts.items()}
    # round ids renumbered 0.. in order of appearance
    _, rid = torch.unique_consecutive(cat["rid"], return_inverse=True)
    return DraftedPositions(rows, cat["row"], cat["ctx"], cat["tok"], TargetLogits.cat(targets), cat["cat"],
                            cat["acc"].bool(), rid, cat["idx"], cat["alpha"], stats)


