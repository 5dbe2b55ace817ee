"""The evaluator on tiny models: consistent acceptance counts, lossless greedy output, report files with every key."""
import json

import pytest
import torch

from specdistill.config import EvalConfig
from specdistill.eval.evaluator import evaluate
from specdistill.eval.report import PLOTS, REQUIRED_KEYS, write_report


def _cfg(**kw):
    base = dict(gamma=4, max_new_tokens=15, batch_size=2, batch_sizes=[2], warmup_prompts=1, ignore_eos=True,
                measure_cost=False)
    return EvalConfig(**(base | kw))


def test_target_as_its_own_draft_accepts_everything(target, tok, prompts):
    g = 4
    r = evaluate(target, tok, "target", prompts, _cfg(gamma=g, max_new_tokens=3 * (g + 1)), progress=False)
    assert r.greedy_mismatches == 0 and r.mismatches == []
    assert r.mean_accept_len == g + 1  # every round drafts g and accepts all: g + 1 tokens per target forward
    assert r.accept_rate_per_pos == [1.0] * g == r.reach_rate_per_pos and r.alpha == 1.0
    assert r.accept_len_hist == [0] * g + [3 * len(prompts)]
    assert r.new_tokens == r.target_only_new_tokens == len(prompts) * 3 * (g + 1)
    tail = evaluate(target, tok, "target", prompts, _cfg(gamma=g, max_new_tokens=13), progress=False)
    assert tail.mean_accept_len == pytest.approx(13 / 3)  # rounds of 5, 5 and the tail's 3 tokens
    assert tail.accept_rate_per_pos == [1.0] * g and tail.greedy_mismatches == 0


def test_counts_are_consistent_with_a_random_draft(target, draft, tok, prompts):
    r = evaluate(target, tok, draft, prompts, _cfg(batch_size=1, batch_sizes=[1], max_new_tokens=16,
                                                   measure_cost=True), progress=False)
    assert r.greedy_mismatches == 0
    hist = torch.tensor(r.accept_len_hist, dtype=torch.float64)
    forwards = hist.sum().item()
    assert forwards == r.target_forwards and r.mean_accept_len == r.new_tokens / forwards
    # per-prompt counts (for confidence intervals over prompts) add up to the totals
    assert sum(x["target_forwards"] for x in r.samples) == forwards and len(r.samples) == len(prompts)
    assert sum(x["new_tokens"] for x in r.samples) == r.new_tokens
    # batch 1, no EOS: no round is cut, so tau = 1 + mean accepted drafts per round, from the histogram alike
    assert r.mean_accept_len == pytest.approx(1 + (hist * torch.arange(len(hist))).sum().item() / forwards)
    assert all(0 <= a <= 1 for a in r.accept_rate_per_pos + r.reach_rate_per_pos)
    assert all(a >= b - 1e-9 for a, b in zip(r.accept_rate_per_pos, r.reach_rate_per_pos))
    assert r.alpha_per_pos == pytest.approx(r.accept_rate_per_pos)  # temperature 0: alpha = acceptance
    assert r.speedup == pytest.approx(r.tokens_per_s / r.target_only_tokens_per_s)
    assert r.cost.c > 0 and r.cost.v > 0 and r.predicted_speedup > 0
    assert r.latency_ms["p50"] <= r.latency_ms["p95"] <= r.latency_ms["p99"]
    assert sum(b["rounds"] for b in r.accept_by_output_position) == forwards


def test_ngram_dynamic_gamma_and_sampling(target, tok, prompts):
    r = evaluate(target, tok, "ngram", prompts, _cfg(dynamic_gamma=True, gamma=2, max_gamma=6, ignore_eos=False),
                 progress=False)
    assert r.greedy_mismatches == 0 and r.dynamic_gamma and 0 < r.mean_gamma <= 6
    assert len(r.accept_rate_per_pos) == 6 and len(r.accept_len_hist) == 7
    s = evaluate(target, tok, "target", prompts[:2], _cfg(temperature=1.0, top_p=0.9, warmup_prompts=0,
                                                          draft_policy="sample"), progress=False)
    assert s.greedy_mismatches is None and s.new_tokens == 2 * 15
    assert s.alpha == pytest.approx(1.0)  # the same model on both sides, drafts sampled from q: p == q


def test_report_files_and_required_keys(target, draft, tok, prompts, tmp_path):
    r = evaluate(target, tok, draft, prompts, _cfg(batch_sizes=[1, 2], sweep_prompts=2, max_new_tokens=8,
                                                   measure_cost=True), progress=False)
    assert [p.batch_size for p in r.batch_sweep] == [1, 2] and r.batch_sweep[0].num_prompts == 2
    paths = write_report(r, tmp_path / "out")
    data = json.loads(paths["results.json"].read_text())  # strict JSON: NaN would have been written as null
    for key in REQUIRED_KEYS:
        assert key in data, key
    assert data["gamma"] == 4 and data["num_prompts"] == 4 and data["temperature"] == 0.0
    assert data["new_tokens"] == sum(json.loads(line)["new_tokens"] for line in paths["outputs.jsonl"].open())
    assert data["speedup"] == pytest.approx(data["tokens_per_s"] / data["target_only_tokens_per_s"])
    for name in PLOTS:
        assert (tmp_path / "out" / name).stat().st_size > 1000
    md = paths["results.md"].read_text()
    assert "speedup" in md and "Batch-size sweep" in md


def test_hf_assisted_generation_gives_the_same_tokens(target, draft, tok, prompts):
    r = evaluate(target, tok, draft, prompts[:2], _cfg(batch_size=1, batch_sizes=[1], max_new_tokens=10,
                                                       ignore_eos=False, compare_hf=True), progress=False)
    for mode in ("hf_assisted_gamma", "hf_assisted_default", "hf_target_only"):
        assert r.hf[mode]["identical_outputs"] == 2, mode
        assert r.hf[mode]["time_ratio_ours_over_hf"] > 0
    assert draft.generation_config.num_assistant_tokens is None  # settings restored
    n = evaluate(target, tok, "ngram", prompts[:2], _cfg(batch_size=2, max_new_tokens=10, ignore_eos=True,
                                                         compare_hf=True), progress=False)
    assert n.hf["hf_assisted_gamma"]["identical_outputs"] == 2 and n.hf["num_prompts"] == 2  # batch-1 pass of its own


def test_bad_config_and_inputs(target, tok, prompts):
    with pytest.raises(ValueError, match="eval.drafter"):
        evaluate(target, tok, "ngram", prompts, _cfg(drafter="eagle"))
    with pytest.raises(ValueError, match="temperature=0"):
        evaluate(target, tok, "ngram", prompts, _cfg(compare_hf=True, temperature=0.5))
    with pytest.raises(ValueError, match="prompt set is empty"):
        evaluate(target, tok, "ngram", [], _cfg())
    with pytest.raises(ValueError, match="unknown drafter"):
        evaluate(target, tok, "medusa", prompts, _cfg())
