"""Per-category tau and a_k: MT-bench prompts carry their category, the evaluator's per-prompt counts (outputs.jsonl)
add up to its totals, and a category's numbers are the ratio of sums over its own prompts."""
import pytest
import torch

from specdistill.config import EvalConfig
from specdistill.data.prompts import load_prompts, tokenize_prompts
from specdistill.eval.evaluator import evaluate
from specdistill.eval.metrics import category_summary
from specdistill.eval.report import markdown


def test_mt_bench_prompts_carry_their_eight_categories(tok):
    ps = load_prompts("embedded:mt_bench", tok, num_prompts=None, max_new_tokens=8)
    counts = {c: ps.categories.count(c) for c in set(ps.categories)}
    assert counts == {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                      "humanities")}


def _prompt_set(tok, prompts, categories):
    ps = tokenize_prompts(tok, list(enumerate(prompts)), None, 16)
    for p, c in zip(ps.prompts, categories):
        p.category = c
    return ps


@pytest.mark.parametrize("batch_size", [1, 3])
def test_per_category_counts_add_up_to_the_totals(target, tok, prompts, batch_size):
    # the target drafting its own argmax at T=1 (greedy policy): some drafts accepted, some not, at every position
    ps = _prompt_set(tok, prompts, ["a", "b", "a", "b"])
    cfg = EvalConfig(gamma=3, max_new_tokens=16, batch_size=batch_size, batch_sizes=[batch_size], warmup_prompts=0,
                     measure_cost=False, temperature=1.0, draft_policy="greedy", seed=3)
    r = evaluate(target, tok, "target", ps, cfg, progress=False)
    assert [s["category"] for s in sorted(r.samples, key=lambda s: s["prompt"])] == ["a", "b", "a", "b"]
    cats = r.by_category
    assert set(cats) == {"a", "b"} and all(c["prompts"] == 2 for c in cats.values())
    assert sum(c["new_tokens"] for c in cats.values()) == r.new_tokens
    assert sum(c["target_forwards"] for c in cats.values()) == r.target_forwards
    # per-prompt reached / accepted per position sum to the evaluator's own a_k
    reached = torch.tensor([s["reached_per_pos"] for s in r.samples]).sum(0)
    accepted = torch.tensor([s["accepted_per_pos"] for s in r.samples]).sum(0)
    assert (accepted / reached.clamp(min=1)).tolist() == pytest.approx(r.accept_rate_per_pos)
    assert 0 < accepted.sum() < reached.sum()  # a test that can fail: neither all nor nothing accepted
    # one category holding every prompt is the whole evaluation
    whole = category_summary([s | {"category": "all"} for s in r.samples])["all"]
    assert whole["tau"] == pytest.approx(r.mean_accept_len)
    assert whole["accept_rate_per_pos"] == pytest.approx(r.accept_rate_per_pos)
    for name, c in cats.items():  # each category: the ratio of sums over its own prompts
        own = [s for s in r.samples if s["category"] == name]
        assert c["tau"] == pytest.approx(sum(s["new_tokens"] for s in own) / sum(s["target_forwards"] for s in own))
    assert "## Per category" in markdown(r)


def test_prompts_without_categories_report_none(target, tok, prompts):
    cfg = EvalConfig(gamma=2, max_new_tokens=6, batch_size=2, batch_sizes=[2], warmup_prompts=0, measure_cost=False)
    r = evaluate(target, tok, "ngram", prompts, cfg, progress=False)
    assert r.by_category == {} and all(s["category"] is None for s in r.samples)
    assert "Per category" not in markdown(r)
