"""One EvalResult from the results of processes that each evaluated a share of the prompts (no model, no clock).

Counts are summed and every ratio is taken again over the sums, so the acceptance figures (tau, a_k, alpha, the
accept-length histogram, greedy mismatches, per-category figures) equal those of one process decoding the same
batches; so do reach_rate_per_pos (from proposed_per_pos) and mean gamma. The per-output-position accept rate keeps
only each process's ratio, so it is weighted by rounds. Speeds are summed tokens over summed seconds, the per-process
throughput; latency percentiles are the token-weighted mean of the processes' percentiles; the cost model is the
first process's. At temperature > 0 each process draws from its own seed stream, so the merged counts are another
sample than one process's, not the same one.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from specdistill.eval.metrics import category_summary, leviathan_speedup, output_position_summary
from specdistill.eval.results import EvalResult, SweepPoint


def _sum_lists(lists: list[list[float]]) -> list[float]:
    width = max((len(x) for x in lists), default=0)
    return [sum(x[k] for x in lists if k < len(x)) for k in range(width)]


def _per_pos(samples: list[dict], key: str) -> list[int]:
    return _sum_lists([s[f"{key}_per_pos"] for s in samples])


def _weighted(values: list[float], weights: list[float]) -> float:
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights)) / total if total > 0 else math.nan


def merge_results(parts: list[EvalResult], prompt_index: list[list[int]]) -> EvalResult:
    """parts[i]: process i's result on the prompts prompt_index[i] (their indices in the whole set, in its order).
    Returns the whole set's result; fields not recomputed here are the first process's."""
    parts, prompt_index = zip(*[(r, ix) for r, ix in zip(parts, prompt_index) if r is not None])
    first = parts[0]
    samples = sorted(({**s, "prompt": ix[s["prompt"]]} for r, ix in zip(parts, prompt_index) for s in r.samples),
                     key=lambda s: s["prompt"])
    mismatches = [{**m, "prompt": ix[m["prompt"]]} for r, ix in zip(parts, prompt_index) for m in r.mismatches]
    forwards = sum(r.target_forwards for r in parts)
    new_tokens = sum(r.new_tokens for r in parts)
    target_tokens = sum(r.target_only_new_tokens for r in parts)
    counted = sum(round(r.mean_accept_len * r.target_forwards) for r in parts)  # tau = tokens / forwards
    reached, accepted = _per_pos(samples, "reached"), _per_pos(samples, "accepted")
    proposed = _sum_lists([r.proposed_per_pos for r in parts])
    alpha_reached = _sum_lists([[a * n for a, n in zip(r.alpha_per_pos, _per_pos(r.samples, "reached"))]
                                for r in parts])
    mean_gamma = sum(r.mean_gamma * r.target_forwards for r in parts) / max(forwards, 1)
    alpha = sum(alpha_reached) / max(sum(reached), 1)

    seconds = sum(r.seconds for r in parts)
    target_seconds = sum(r.target_only_seconds for r in parts)
    tps = new_tokens / seconds if seconds > 0 else math.nan
    target_tps = target_tokens / target_seconds if target_seconds > 0 else math.nan
    decode_s = sum(r.new_tokens / r.decode_tokens_per_s for r in parts if r.decode_tokens_per_s > 0)
    target_decode_s = sum(r.target_only_new_tokens / r.target_only_decode_tokens_per_s for r in parts
                          if r.target_only_decode_tokens_per_s > 0)
    decode_tps = new_tokens / decode_s if decode_s > 0 else math.nan
    target_decode_tps = target_tokens / target_decode_s if target_decode_s > 0 else math.nan
    tokens = [r.new_tokens for r in parts]
    batches = [math.ceil(r.num_prompts / max(r.batch_size, 1)) for r in parts]

    cost = first.cost
    pred_tau = pred = pred_measured = None
    tau = counted / max(forwards, 1)
    if cost is not None and mean_gamma > 0:
        pred_tau, pred = leviathan_speedup(alpha, mean_gamma, cost.c)
        pred_measured = tau / (mean_gamma * cost.c + cost.v)
    greedy = first.temperature == 0
    mismatch_count = sum(r.greedy_mismatches for r in parts) if greedy else None
    num_prompts = sum(r.num_prompts for r in parts)
    speedup = tps / target_tps
    return replace(
        first, num_prompts=num_prompts, new_tokens=new_tokens, target_only_new_tokens=target_tokens,
        target_forwards=forwards, mean_gamma=mean_gamma, mean_accept_len=tau,
        accept_rate_per_pos=(torch.tensor(accepted) / torch.tensor(reached).clamp(min=1)).tolist(),  # as SpecCounts
        reach_rate_per_pos=(torch.tensor(accepted) / torch.tensor(proposed).clamp(min=1)).tolist(),
        proposed_per_pos=[int(x) for x in proposed],
        alpha=alpha, alpha_per_pos=[a / max(n, 1) for a, n in zip(alpha_reached, reached)],
        accept_len_hist=[int(x) for x in _sum_lists([r.accept_len_hist for r in parts])],
        accept_by_output_position=output_position_summary(samples, first.position_buckets),
        tokens_per_s=tps, target_only_tokens_per_s=target_tps, speedup=speedup,
        decode_tokens_per_s=decode_tps, target_only_decode_tokens_per_s=target_decode_tps,
        decode_speedup=decode_tps / target_decode_tps, seconds=seconds, target_only_seconds=target_seconds,
        prefill_ms_mean=_weighted([r.prefill_ms_mean for r in parts], batches),
        target_only_prefill_ms_mean=_weighted([r.target_only_prefill_ms_mean for r in parts], batches),
        latency_ms=_merge_latency([r.latency_ms for r in parts], tokens),
        target_only_latency_ms=_merge_latency([r.target_only_latency_ms for r in parts],
                                              [r.target_only_new_tokens for r in parts]),
        round_cost_ratio=_weighted([r.round_cost_ratio for r in parts], tokens),
        predicted_tau_from_alpha=pred_tau, predicted_speedup=pred, predicted_speedup_measured_tau=pred_measured,
        greedy_mismatches=mismatch_count, mismatches=mismatches, by_category=category_summary(samples),
        batch_sweep=[SweepPoint(first.batch_size, num_prompts, tps, target_tps, speedup, tau, mismatch_count)],
        env={**first.env, "processes": len(parts)}, samples=samples)


def _merge_latency(tables: list[dict], weights: list[float]) -> dict:
    keys = tables[0].keys()
    return {k: _weighted([t[k] for t in tables], weights) for k in keys}


def shares(num_prompts: int, batch_size: int, processes: int) -> list[list[int]]:
    """Prompt indices per process: whole batches of the single-process order, batch b to process b % processes, so
    each batch holds the same prompts (and padding) as when one process decodes them all."""
    out: list[list[int]] = [[] for _ in range(processes)]
    for b, start in enumerate(range(0, num_prompts, batch_size)):
        out[b % processes].extend(range(start, min(start + batch_size, num_prompts)))
    return out

