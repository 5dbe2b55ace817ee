"""The evaluator's pure counters and formulas (no model, no clock): acceptance counts, latency percentiles, speedup.

SpecCounts sums acceptance over rollouts, row_acceptance keeps the same counts per row (per prompt, for per-category
and paired comparisons: category_summary), weighted_percentiles gives token-weighted latency percentiles, and
leviathan_speedup is Leviathan et al.'s (2023) predicted speedup. output_position_summary turns per-prompt counts by
bucket of output position (specdistill.output_positions, shared with Draft-OPD's rollouts) into rates with bootstrap
intervals over prompts, and paired_output_positions compares runs bucket by bucket. Tests call them directly
(tests/eval/test_eval_metrics.py, tests/eval/test_eval_categories.py, tests/eval/test_output_buckets.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specdistill.decoding import Rollout
from specdistill.eval.stats import ratio_interval, sum_ratio_interval
from specdistill.output_positions import BucketCounts, bucket_label, bucket_name


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
    """One round -> (accepted (R, K), reached (R, K)) over the rows it ran: draft k accepted / drafted with drafts
    1..k-1 accepted, active rows only."""
    active = rnd.active.cpu()
    acc = rnd.accepted.cpu() & active[:, None]                          # (R, K)
    reach = torch.cat([active[:, None], acc[:, :-1]], dim=1)            # (R, K)
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
            rows = rnd.row_ids().cpu()                                      # (R,) the rollout's rows the round ran
            out.reached[rows, :rnd.gamma] += reach.long()
            out.accepted[rows, :rnd.gamma] += acc.long()
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


def output_position_summary(samples: list[dict], starts: Sequence[int], seed: int = 0) -> list[dict]:
    """Per-prompt bucket counts (the evaluator's samples: "output_buckets" {name: {rounds, tokens, proposed,
    accepted}}) -> one row per bucket that some prompt reached: summed counts, tau = tokens / rounds and accept_rate =
    accepted / proposed (ratios of sums), each with a 95% bootstrap interval over the prompts that reached the bucket
    (None with fewer than two)."""
    out = []
    for s, e in zip(starts, list(starts[1:]) + [None]):
        name = bucket_name(s, e)
        cells = [x["output_buckets"][name] for x in samples if x.get("output_buckets", {}).get(name, {}).get("rounds")]
        if not cells:
            continue
        tot = {k: sum(c[k] for c in cells) for k in ("rounds", "tokens", "proposed", "accepted")}
        out.append({"start": s, "end": e, "name": name, "label": bucket_label(s, e), "prompts": len(cells), **tot,
                    "tau": tot["tokens"] / max(tot["rounds"], 1),
                    "tau_ci95": sum_ratio_interval([[c["tokens"], c["rounds"]] for c in cells], seed),
                    "accept_rate": tot["accepted"] / max(tot["proposed"], 1),
                    "accept_rate_ci95": sum_ratio_interval([[c["accepted"], c["proposed"]] for c in cells], seed)})
    return out


def _finite(ci: Optional[list[float]]) -> Optional[list[float]]:
    """An interval, or None where a resample's baseline rate was 0 (an unbounded ratio)."""
    return ci if ci is not None and all(math.isfinite(x) for x in ci) else None


def _bucket_of(name: str) -> tuple[int, Optional[int]]:
    """bucket_name's inverse: "0_127" -> (0, 128), "1024_plus" -> (1024, None)."""
    start, _, last = name.partition("_")
    return int(start), None if last == "plus" else int(last) + 1


def paired_output_positions(samples: dict[str, list[dict]], baseline: str, seed: int = 0) -> dict[str, dict]:
    """Runs on the same prompts, {run: per-prompt samples} (each with "prompt" and "output_buckets"), against the
    baseline run per bucket of output position: {bucket name: {start, end, label, runs: {run: {prompts, tau,
    accept_rate, tau_ratio, accept_rate_ratio}}}} with 95% intervals (*_ci95). The ratios are run / baseline over the
    prompts where both reached the bucket, their intervals a PAIRED bootstrap (the same resampled prompts for both;
    None where the baseline's rate is 0 or fewer than 2 prompts pair). {} unless every sample of every run carries
    output_buckets."""
    if not samples or any("output_buckets" not in s for rows in samples.values() for s in rows):
        return {}
    by_prompt = {run: {s["prompt"]: s["output_buckets"] for s in rows} for run, rows in samples.items()}
    base = by_prompt[baseline]
    names = sorted({n for cells in base.values() for n in cells}, key=lambda n: _bucket_of(n)[0])
    out = {}
    for name in names:
        row = {}
        for run, cells in by_prompt.items():
            both = [p for p in sorted(cells) if name in cells[p] and name in base.get(p, {})]
            if not both:
                continue
            a, b = [cells[p][name] for p in both], [base[p][name] for p in both]
            row[run] = {"prompts": len(both)} | _paired_rates(a, b, seed, with_own=True)
        start, end = _bucket_of(name)
        out[name] = {"start": start, "end": end, "label": bucket_label(start, end), "runs": row}
    return out


def _paired_rates(a: list[dict], b: list[dict], seed: int, with_own: bool = False) -> dict:
    """Bucket cells a and b of the same prompts, row k of each the same prompt ({rounds, tokens, proposed,
    accepted}) -> tau and acceptance rate of a over b, with paired bootstrap intervals: {tau_ratio, tau_ratio_ci95,
    accept_rate_ratio, accept_rate_ratio_ci95} (None where b's rate is 0), and with_own a's own rates
    {tau, tau_ci95, accept_rate, accept_rate_ci95}."""
    out = {}
    for key, num, den in (("tau", "tokens", "rounds"), ("accept_rate", "accepted", "proposed")):
        pa, pb = [[c[num], c[den]] for c in a], [[c[num], c[den]] for c in b]
        ra = sum(x for x, _ in pa) / max(sum(y for _, y in pa), 1)
        rb = sum(x for x, _ in pb) / max(sum(y for _, y in pb), 1)
        if with_own:
            out |= {key: ra, f"{key}_ci95": sum_ratio_interval(pa, seed)}
        out |= {f"{key}_ratio": ra / rb if rb > 0 else None,
                f"{key}_ratio_ci95": _finite(ratio_interval(pa, pb, seed)) if rb > 0 else None}
    return out


def last_over_first(samples: list[dict], seed: int = 0) -> Optional[dict]:
    """Acceptance along the output within the same prompts: per-prompt samples (each with "output_buckets") -> tau
    and acceptance rate in the last bucket at least 2 prompts reached over the SAME prompts' first bucket, with
    paired bootstrap intervals over those prompts: {first, last (labels), prompts, tau_ratio, tau_ratio_ci95,
    accept_rate_ratio, accept_rate_ratio_ci95}. Pairing removes what a pooled curve mixes in: which prompts are left
    in the later buckets. None without per-prompt buckets or a later bucket 2 prompts reached."""
    cells = [s["output_buckets"] for s in samples if s.get("output_buckets")]
    names = sorted({n for c in cells for n in c}, key=lambda n: _bucket_of(n)[0])
    later = [n for n in names[1:] if sum(n in c for c in cells) >= 2]
    if not later:
        return None
    first, last = names[0], later[-1]
    both = [c for c in cells if first in c and last in c]
    return {"first": bucket_label(*_bucket_of(first)), "last": bucket_label(*_bucket_of(last)),
            "prompts": len(both)} | _paired_rates([c[last] for c in both], [c[first] for c in both], seed)


def row_bucket_counts(buckets: list[BucketCounts], row: int) -> dict[str, dict]:
    """One row's non-empty buckets as {name: {rounds, tokens, proposed, accepted}} (the evaluator's per-prompt
    samples, outputs.jsonl)."""
    return {b.name: {"rounds": int(b.rounds[row]), "tokens": int(b.tokens[row]), "proposed": int(b.proposed[row]),
                     "accepted": int(b.accepted[row])} for b in buckets if int(b.rounds[row]) > 0}


class SpecCounts:
    """Acceptance counts summed over rollouts: the Rollout's own counters plus what needs the round records
    (whether a drafted position's prefix was accepted). Acceptance by output position is per prompt
    (output_position_buckets, summed by output_position_summary)."""

    def __init__(self, max_gamma: int):
        G = max_gamma
        self.G = G
        self.tokens = self.forwards = 0
        self.proposed = torch.zeros(G, dtype=torch.long)
        self.accepted = torch.zeros(G, dtype=torch.long)
        self.reached = torch.zeros(G, dtype=torch.long)        # drafted at k with drafts 1..k-1 accepted
        self.alpha_reached = torch.zeros(G, dtype=torch.float64)
        self.hist = torch.zeros(G + 1, dtype=torch.long)

    def add(self, r: Rollout) -> None:
        G = self.G
        self.tokens += int(r.num_new_tokens.sum())
        self.forwards += int(r.target_forwards.sum())
        self.proposed += r.position_proposed.cpu()[:G]
        self.accepted += r.position_accepted.cpu()[:G]
        self.hist += r.accept_hist.cpu()[:G + 1]
        for rnd in r.rounds:
            K = rnd.gamma
            if K:
                _, reach = _reach(rnd)                                              # (B, K)
                self.reached[:K] += reach.sum(0)
                self.alpha_reached[:K] += (rnd.alpha.cpu().double() * reach).sum(0)

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


def leviathan_speedup(alpha: float, gamma: float, c: float) -> tuple[float, float]:
    """(expected tokens per target forward, expected speedup) for i.i.d. acceptance alpha (Leviathan et al. 2023)."""
    tau = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tau, tau / (gamma * c + 1)
