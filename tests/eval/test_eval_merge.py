"""eval/merge.py: results of processes that each evaluated a share of the prompt batches merge into the counts one
process gives on all of them (greedy decoding, so every batch decodes the same tokens wherever it runs)."""
from dataclasses import replace

import pytest
import torch

from specdistill.config import EvalConfig
from specdistill.data.prompts import tokenize_prompts
from specdistill.eval.evaluator import evaluate
from specdistill.eval.merge import merge_results, shares
from tests.eval.conftest import PROMPTS

EXACT = ("num_prompts", "new_tokens", "target_only_new_tokens", "target_forwards", "mean_accept_len",
         "accept_rate_per_pos", "reach_rate_per_pos", "proposed_per_pos", "accept_len_hist", "greedy_mismatches",
         "by_category")


@pytest.fixture(scope="module")
def close_draft(tok):
    """The target with a perturbed output layer: accepted at some positions, rejected at others (a_k near 0.6)."""
    from tests.conftest import make_tiny_lm

    d = make_tiny_lm(len(tok), layers=2, hidden=64, seed=0).eval().requires_grad_(False)
    d.lm_head.weight.add_(torch.randn(d.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.01)
    return d


@pytest.mark.parametrize("processes", [2, 3])
def test_shares_merge_into_the_one_process_counts(target, close_draft, tok, processes):
    draft = close_draft
    ps = tokenize_prompts(tok, list(enumerate(PROMPTS + [[{"role": "user", "content": "the cat sat on the mat"}]])),
                          None, 12)
    for p, c in zip(ps.prompts, "abaab"):
        p.category = c
    cfg = EvalConfig(gamma=3, max_new_tokens=12, batch_size=2, batch_sizes=[2], warmup_prompts=0, measure_cost=False)
    one = evaluate(target, tok, draft, ps, cfg, progress=False, log=lambda *_: None)
    index = shares(len(ps), cfg.batch_size, processes)
    parts = [evaluate(target, tok, draft, replace(ps, prompts=[ps.prompts[i] for i in ix]), cfg, progress=False,
                      log=lambda *_: None) if ix else None for ix in index]
    merged = merge_results(parts, index)
    assert 0 < min(one.accept_rate_per_pos) and max(one.accept_rate_per_pos) < 1  # partial acceptance: counts matter
    for k in EXACT:
        assert getattr(merged, k) == getattr(one, k), k
    torch.testing.assert_close(torch.tensor(merged.alpha_per_pos), torch.tensor(one.alpha_per_pos))
    assert merged.mean_gamma == pytest.approx(one.mean_gamma)
    assert [s["prompt"] for s in merged.samples] == list(range(len(ps)))
    assert [s["new_tokens"] for s in merged.samples] == [s["new_tokens"] for s in sorted(one.samples,
                                                                                      key=lambda s: s["prompt"])]
    assert merged.env["processes"] == sum(1 for p in parts if p is not None)
