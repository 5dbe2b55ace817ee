"""eval.draft_policy end to end: the target drafting for itself at T=1 is always accepted when it samples its drafts
(q = p) and only as often as p(argmax) under the engines' greedy policy; results.json records the policy."""
import json

import pytest

from specdistill.config import EvalConfig
from specdistill.eval.evaluator import evaluate
from specdistill.eval.report import write_report


def _cfg(**kw):
    base = dict(gamma=3, max_new_tokens=8, batch_size=2, batch_sizes=[2], warmup_prompts=0, ignore_eos=True,
                measure_cost=False, temperature=1.0)
    return EvalConfig(**(base | kw))


def test_self_drafting_target_separates_the_policies(target, tok, prompts, tmp_path):
    sampled = evaluate(target, tok, "target", prompts, _cfg(draft_policy="sample"), progress=False)
    greedy = evaluate(target, tok, "target", prompts, _cfg(draft_policy="greedy"), progress=False)
    # sample: q == p, so every draft is accepted (alpha = sum min(p, p) = 1); greedy: accepted with p(argmax) < 1
    assert sampled.alpha == pytest.approx(1.0, abs=1e-5) and sampled.mean_accept_len == 4.0
    assert greedy.alpha < 0.9 and greedy.mean_accept_len < 4.0
    data = json.loads(write_report(greedy, tmp_path, plots=False)["results.json"].read_text())
    assert (data["draft_policy"], data["temperature"]) == ("greedy", 1.0)
    assert "draft policy (T > 0) | greedy" in (tmp_path / "results.md").read_text()


def test_unknown_policy_is_a_clear_error(target, tok, prompts):
    with pytest.raises(ValueError, match="eval.draft_policy='argmax'.*greedy.*sample"):
        evaluate(target, tok, "target", prompts, _cfg(draft_policy="argmax"), progress=False)
