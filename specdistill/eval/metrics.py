"""The evaluator's pure counters and formulas (no model, no clock): acceptance counts, latency percentiles, speedup.

SpecCounts sums acceptance over rollouts, weighted_percentiles gives token-weighted latency percentiles, and
leviathan_speedup is Leviathan et al.'s (2023) predicted speedup. Tests call them directly
(tests/eval/test_eval_metrics.py).
"""
from __future__ import annotations

import math

import torch

from specdistill.decoding import Rollout


def weighted_percentiles(values: list[float], weights: list[float], qs=(50, 95, 99)) -> dict:
    """Percentiles (in ms) of `values` (seconds) weighted by `weights`, and the weighted mean: {"p50", .., "mean"}."""
    if not values:
        return {f"p{q}": math.nan for q in qs} | {"mean": math.nan}
    v = torch.tensor(values, dtype=torch.float64)
    w = torch.tensor(weights, dtype=torch.float64)
    order = v.argsort()
    v, w = v[order], w[order]
    cum = w.cumsum(0) / w.sum()
    out = {f"p{q}": 1000 * v[min(int(torch.searchsorted(cum, q / 100)), len(v) - 1)].item() for q in qs}
    out["mean"] = 1000 * (v * w).sum().item() / w.sum().item()
    return out


class SpecCounts:
    """Acceptance counts summed over rollouts: the Rollout's own counters plus what needs the round records
    (whether a drafted position's prefix was accepted, and where in the output the round started)."""

    def __init__(self, max_gamma: int, bucket: int):
        G = max_gamma
        self.G, self.bucket = G, bucket
        self.tokens = self.forwards = 0
        self.proposed = torch.zeros(G, dtype=torch.long)
        self.accepted = torch.zeros(G, dtype=torch.long)
        self.reached = torch.zeros(G, dtype=torch.long)        # drafted at k with drafts 1..k-1 accepted
        self.alpha_reached = torch.zeros(G, dtype=torch.float64)
        self.hist = torch.zeros(G + 1, dtype=torch.long)
        self.by_pos: dict[int, list[int]] = {}                   # bucket -> [rounds, tokens, proposed, accepted]

    def add(self, r: Rollout) -> None:
        G = self.G
        self.tokens += int(r.num_new_tokens.sum())
        self.forwards += int(r.target_forwards.sum())
        self.proposed += r.position_proposed.cpu()[:G]
        self.accepted += r.position_accepted.cpu()[:G]
        self.hist += r.accept_hist.cpu()[:G + 1]
        for rnd in r.rounds:
            active = rnd.active.cpu()
            K = rnd.gamma
            if K:
                acc = rnd.accepted.cpu() & active[:, None]                          # (B, K)
                reach = torch.cat([active[:, None], acc[:, :-1]], dim=1)            # (B, K)
                self.reached[:K] += reach.sum(0)
                self.alpha_reached[:K] += (rnd.alpha.cpu().double() * reach).sum(0)
            starts = (rnd.offset.cpu() // self.bucket).tolist()
            for b in active.nonzero().flatten().tolist():
                cell = self.by_pos.setdefault(starts[b], [0, 0, 0, 0])
                cell[0] += 1
                cell[1] += int(rnd.num_emitted[b])
                cell[2] += K
                cell[3] += int(rnd.num_accepted[b])

    # ratios of sums
    def tau(self) -> float:
        return self.tokens / max(self.forwards, 1)

    def accept_rate_per_pos(self) -> list[float]:
        return (self.accepted / self.reached.clamp(min=1)).tolist()

    def reach_rate_per_pos(self) -> list[float]:
        return (self.accepted / self.proposed.clamp(min=1)).tolist()

    def alpha_per_pos(self) -> list[float]:
        return (self.alpha_reached / self.reached.clamp(min=1)).tolist()

    def alpha(self) -> float:
        return (self.alpha_reached.sum() / self.reached.sum().clamp(min=1)).item()

    def mean_gamma(self) -> float:
        return self.proposed.sum().item() / max(self.forwards, 1)

    def by_output_position(self) -> list[dict]:
        out = []
        for b in sorted(self.by_pos):
            rounds, tokens, proposed, accepted = self.by_pos[b]
            out.append({"start": b * self.bucket, "end": (b + 1) * self.bucket, "rounds": rounds, "tokens": tokens,
                        "tau": tokens / max(rounds, 1), "accept_rate": accepted / max(proposed, 1)})
        return out


def leviathan_speedup(alpha: float, gamma: float, c: float) -> tuple[float, float]:
    """(expected tokens per target forward, expected speedup) for i.i.d. acceptance alpha (Leviathan et al. 2023)."""
    tau = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tau, tau / (gamma * c + 1)
