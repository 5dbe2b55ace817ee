"""The evaluator's pure metrics (eval/metrics.py) on hand-made rollouts and numbers: no model, no clock."""
import math
import random

import pytest
import torch

from specdistill.decoding import RoundRecord, Rollout
from specdistill.eval.metrics import SpecCounts, leviathan_speedup, weighted_percentiles


def _round(accepted: torch.Tensor, offset: int) -> RoundRecord:
    B, K = accepted.shape
    n = accepted.long().cumprod(1).sum(1)
    z = torch.zeros(B, dtype=torch.long)
    return RoundRecord(gamma=K, active=torch.ones(B, dtype=torch.bool), offset=z + offset,
                       draft_tokens=z[:, None].expand(B, K),
                       accepted=accepted.long().cumprod(1).bool(), num_accepted=n, next_token=z, num_emitted=n + 1,
                       alpha=accepted.long().cumprod(1).float())


def test_tau_is_one_plus_sum_of_products_when_every_round_drafts_gamma():
    g, rng = 5, random.Random(0)
    rounds = [_round(torch.tensor([[rng.random() < 0.8 - 0.1 * k for k in range(g)] for _ in range(3)]), 6 * i)
              for i in range(40)]
    n = torch.stack([rd.num_accepted for rd in rounds])
    r = Rollout(sequences=torch.zeros(3, 1), num_new_tokens=(n + 1).sum(0), rounds=rounds,
                target_forwards=torch.full((3,), 40), accept_hist=torch.bincount(n.flatten(), minlength=g + 1),
                position_proposed=torch.full((g,), 120),
                position_accepted=torch.stack([rd.accepted for rd in rounds]).sum((0, 1)),
                position_alpha=torch.zeros(g), prefill_seconds=0.0, round_seconds=[0.0] * 40)
    c = SpecCounts(g)
    c.add(r)
    a = c.accept_rate_per_pos()
    assert c.tau() == pytest.approx(1 + sum(math.prod(a[: k + 1]) for k in range(g)))
    assert c.alpha_per_pos() == pytest.approx(a)


def test_formulas():
    assert leviathan_speedup(1.0, 4, 0.0) == (5, 5)
    assert leviathan_speedup(0.0, 4, 0.25) == (1.0, 0.5)
    tau, s = leviathan_speedup(0.5, 2, 0.1)
    assert tau == pytest.approx(1.75) and s == pytest.approx(1.75 / 1.2)
    p = weighted_percentiles([0.001, 0.002, 0.010], [98, 1, 1])
    assert p["p50"] == pytest.approx(1.0) and p["p99"] == pytest.approx(2.0) and p["mean"] == pytest.approx(1.1)


def test_counts_of_an_empty_sum_are_zero_not_nan():
    c = SpecCounts(3)
    assert c.tau() == 0 and c.mean_gamma() == 0 and c.alpha() == 0
    assert c.accept_rate_per_pos() == [0.0] * 3
    p = weighted_percentiles([], [])
    assert all(math.isnan(v) for v in p.values()) and set(p) == {"p50", "p95", "p99", "mean"}


def test_per_position_rates_by_hand():
    # one row, two rounds of gamma 2: accepted [1, 0] then [1, 1] -> reached [2, 2], accepted [2, 1]
    rounds = [_round(torch.tensor([[True, False]]), 0), _round(torch.tensor([[True, True]]), 2)]
    n = torch.stack([rd.num_accepted for rd in rounds])
    r = Rollout(sequences=torch.zeros(1, 1), num_new_tokens=(n + 1).sum(0), rounds=rounds,
                target_forwards=torch.tensor([2]), accept_hist=torch.bincount(n.flatten(), minlength=3),
                position_proposed=torch.tensor([2, 2]), position_accepted=torch.tensor([2, 1]),
                position_alpha=torch.zeros(2), prefill_seconds=0.0, round_seconds=[0.0, 0.0])
    c = SpecCounts(2)
    c.add(r)
    assert c.tau() == pytest.approx(5 / 2) and c.mean_gamma() == pytest.approx(2.0)
    assert c.accept_rate_per_pos() == pytest.approx([1.0, 0.5]) and c.reach_rate_per_pos() == pytest.approx([1.0, 0.5])
    assert c.hist.tolist() == [0, 1, 1]
