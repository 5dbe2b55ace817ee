"""The evaluator's pure counters and formulas (no model, no clock): acceptance counts, latency percentiles, speedup.

SpecCounts sums acceptance over rollouts, row_acceptance keeps the same counts per row (per prompt, for per-category
and paired comparisons: category_summary), weighted_percentiles gives token-weighted latency percentiles, and
leviathan_speedup is Leviathan et al.'s (2023) predicted speedup. Tests call them directly
(tests/eval/test_eval_metrics.py, tests/eval/test_eval_categories.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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


def _reach(rnd) -> tuple[torch.Tensor, torch.Tensor]:
    """One round -> (accepted (B, K), reached (B, K)): draft k accepted / drafted with drafts 1..k-1 accepted, active
    rows only."""
    active = rnd.active.cpu()
    acc = rnd.accepted.cpu() & active[:, None]                          # (B, K)
    reach = torch.cat([active[:, None], acc[:, :-1]], dim=1)            # (B, K)
    return acc, reach


@dataclass
class RowAcceptance:
    """Per row of a rollout, summed over its rounds: drafts that reached position k (drafted with drafts 1..k-1
    accepted) and were accepted there. Summed over rows they are SpecCounts' reached and accepted."""
    reached: torch.Tensor    # (B, G) long
    accepted: torch.Tensor   # (B, G) long


def row_acceptance(r: Rollout, max_gamma: int) -> RowAcceptance:
    B, G = r.sequences.shape[0], max_gamma
    out = RowAcceptance(torch.zeros(B, G, dtype=torch.long), torch.zeros(B, G, dtype=torch.long))
    for rnd in r.rounds:
        if rnd.gamma:
            acc, reach = _reach(rnd)
            out.reached[:, :rnd.gamma] += reach.long()
            out.accepted[:, :rnd.gamma] += acc.long()
    return out


def category_summary(samples: list[dict]) -> dict[str, dict]:
    """Per-prompt samples (the evaluator's outputs.jsonl rows: category, new_tokens, target_forwards, reached_per_pos,
    accepted_per_pos) -> {category: prompts, tau, accept_rate_per_pos a_k, summed counts}, ratios of sums within the
    category, categories in first-seen order. Prompts without a category are left out; {} when none has one."""
    sums: dict[str, dict] = {}
    for s in samples:
        cat = s.get("category")
        if cat is None:
            continue
        c = sums.setdefault(cat, {"prompts": 0, "new_tokens": 0, "target_forwards": 0, "reached": None,
                                  "accepted": None})
        c["prompts"] += 1
        c["new_tokens"] += s["new_tokens"]
        c["target_forwards"] += s["target_forwards"]
        for key in ("reached", "accepted"):
            row = torch.tensor(s[f"{key}_per_pos"], dtype=torch.long)
            c[key] = row if c[key] is None else c[key] + row
    return {cat: {"prompts": c["prompts"], "new_tokens": c["new_tokens"], "target_forwards": c["target_forwards"],
                  "tau": c["new_tokens"] / max(c["target_forwards"], 1),
                  "accept_rate_per_pos": (c["accepted"] / c["reached"].clamp(min=1)).tolist()}
            for cat, c in sums.items()}


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
                _, reach = _reach(rnd)                                              # (B, K)
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
