"""Confidence intervals for acceptance length over prompts (the evaluator's per-prompt counts).

tau = sum(new tokens) / sum(target forwards) is a ratio of sums, so its uncertainty from the prompt sample is taken
by the bootstrap over prompts. Two drafts evaluated on the same prompts are compared PAIRED (the same resampled
prompts for both), which removes the prompt-to-prompt spread both share.

counts: (N, 2) per prompt [new tokens, target forwards], as in the evaluator's samples (outputs.jsonl); the same
bootstrap serves any ratio of sums, e.g. a bucket of output positions' [accepted drafts, proposed drafts].
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

Counts = Sequence[Sequence[int]]


def _resampled_tau(c: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """c (N, 2), idx (S, N) -> (S,) ratio of sums (tau) of each resample."""
    return c[idx, 0].sum(1) / c[idx, 1].sum(1).clamp(min=1)


def _quantiles(x: torch.Tensor, level: float) -> list[float]:
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    return torch.quantile(x, q).tolist()


def _indices(n: int, samples: int, seed: int) -> torch.Tensor:
    return torch.randint(n, (samples, n), generator=torch.Generator().manual_seed(seed))


def sum_ratio_interval(counts: Counts, seed: int = 0, samples: int = 2000, level: float = 0.95,
                       ) -> Optional[list[float]]:
    """[lo, hi] bootstrap interval over prompts of any ratio of sums sum(x) / sum(y), counts (N, 2) per prompt [x, y]
    (tau: [new tokens, target forwards]; an acceptance rate: [accepted drafts, proposed drafts]); None with fewer
    than 2 prompts or a zero denominator."""
    c = torch.tensor(counts, dtype=torch.float64).reshape(-1, 2)
    if len(c) < 2 or c[:, 1].sum() <= 0:
        return None
    return _quantiles(_resampled_tau(c, _indices(len(c), samples, seed)), level)


def tau_interval(counts: Counts, seed: int = 0, samples: int = 2000, level: float = 0.95) -> Optional[list[float]]:
    """[lo, hi] bootstrap interval of tau over prompts; None with fewer than 2 prompts or no forwards."""
    return sum_ratio_interval(counts, seed, samples, level)


def ratio_interval(a: Counts, b: Counts, seed: int = 0, samples: int = 2000, level: float = 0.95,
                   ) -> Optional[list[float]]:
    """[lo, hi] paired bootstrap interval of tau_a / tau_b: row k of a and b must be the same prompt. None unless
    both have the same number (>= 2) of prompts."""
    ca = torch.tensor(a, dtype=torch.float64).reshape(-1, 2)
    cb = torch.tensor(b, dtype=torch.float64).reshape(-1, 2)
    if len(ca) != len(cb) or len(ca) < 2 or ca[:, 1].sum() <= 0 or cb[:, 1].sum() <= 0:
        return None
    idx = _indices(len(ca), samples, seed)
    return _quantiles(_resampled_tau(ca, idx) / _resampled_tau(cb, idx), level)
