"""The evaluator decodes token trees (eval.tree); its cost model names the setting of highest predicted speed."""
import pytest

from specdistill.config import EvalConfig, TreeEvalConfig
from specdistill.eval.evaluator import evaluate
from specdistill.eval.report import markdown
from specdistill.eval.tree_cost import Setting, VerifyCurve, best, chain_settings, chain_taus


def _cfg(**kw):
    base = dict(gamma=3, max_new_tokens=12, batch_size=2, batch_sizes=[2], warmup_prompts=1, ignore_eos=True,
                measure_cost=False)
    return EvalConfig(**(base | kw))


def test_tree_evaluation_is_lossless_and_reports_the_tree_and_its_costs(target, draft, tok, prompts):
    tree = TreeEvalConfig(topk=3, depth=3, nodes=8)
    r = evaluate(target, tok, draft, prompts, _cfg(tree=tree, measure_cost=True), progress=False)
    assert r.greedy_mismatches == 0
    assert len(r.accept_rate_per_pos) == 3 and sum(r.accept_len_hist) == r.target_forwards  # acceptance by depth
    assert r.tree["sglang"] == {"--speculative-eagle-topk": 3, "--speculative-num-steps": 3,
                                "--speculative-num-draft-tokens": 9}
    assert r.tree["draft_round_ms"] > 0 and r.tree["v"] > 0 and r.tree["nodes"] == 8
    model = r.cost_model
    assert len(model["v_curve"]) == 32 and model["v_curve"][0] == pytest.approx(model["v_curve_ms"][0] /
                                                                                model["target_step_ms"])
    assert model["recommended"] == "tree3x3n8"
    md = markdown(r)
    assert "--speculative-num-draft-tokens 9" in md and "Recommended: **tree3x3n8**" in md
    assert model["recommended_predicted_speedup"] == pytest.approx(r.mean_accept_len / (r.tree["d"] + r.tree["v"]))


def test_the_target_drafting_its_own_chain_shaped_tree_accepts_every_depth(target, tok, prompts):
    """topk=1 (wider trees keep the best cumulative probabilities, which can drop the argmax path: beam search)."""
    r = evaluate(target, tok, "target", prompts, _cfg(tree=TreeEvalConfig(topk=1, depth=3), max_new_tokens=16),
                 progress=False)
    assert r.greedy_mismatches == 0 and r.mean_accept_len == 4.0 and r.accept_rate_per_pos == [1.0] * 3


def test_chain_runs_name_the_best_chain_length(target, draft, tok, prompts):
    r = evaluate(target, tok, draft, prompts[:2], _cfg(measure_cost=True, gamma=4), progress=False)
    names = [s["name"] for s in r.cost_model["settings"]]
    assert names == ["chain1", "chain2", "chain3", "chain4"] and r.tree is None
    assert r.cost_model["recommended"] == max(r.cost_model["settings"], key=lambda s: s["predicted_speedup"])["name"]


def test_bad_tree_settings_are_refused_by_name(target, tok, prompts):
    with pytest.raises(ValueError, match="eval.tree: tree nodes=9 exceeds the 6 nodes"):
        evaluate(target, tok, "target", prompts, _cfg(tree=TreeEvalConfig(topk=2, depth=2, nodes=9)), progress=False)
    with pytest.raises(ValueError, match="eval.tree decodes token trees.*draft_policy=greedy"):
        evaluate(target, tok, "target", prompts, _cfg(tree=TreeEvalConfig(topk=2), temperature=1.0,
                                                      draft_policy="sample"), progress=False)
    with pytest.raises(ValueError, match="NGramDrafter proposes one token per position"):
        evaluate(target, tok, "ngram", prompts, _cfg(tree=TreeEvalConfig(topk=2)), progress=False)


def test_the_cost_model_picks_the_highest_predicted_speed():
    assert chain_taus([0.5, 0.5]) == [1.0, 1.5, 1.75]
    curve = VerifyCurve(step_ms=10.0, ms=[10.0, 11.0, 12.0, 20.0], context_tokens=5)
    settings = chain_settings([0.9, 0.8, 0.7], c=0.1, curve=curve)
    # tau 1.9 / (0.1 + 1.1), 2.62 / (0.2 + 1.2), 3.124 / (0.3 + 2.0)
    assert [round(s.predicted_speedup, 4) for s in settings] == [round(1.9 / 1.2, 4), round(2.62 / 1.4, 4),
                                                                 round(3.124 / 2.3, 4)]
    assert best(settings).name == "chain2"
    assert best(settings + [Setting("tree2x2", 3.0, 0.3, 5, 1.0)]).name == "tree2x2"
    with pytest.raises(ValueError, match=r"v\(9\) was not measured"):
        curve.v(9)
    # bookkeeping that grows with the length enters each chain's cost (and never goes below 0)
    grown = chain_settings([0.9, 0.8, 0.7], c=0.1, curve=curve, overhead=lambda g: 0.1 * g - 0.15)
    assert [s.overhead for s in grown] == pytest.approx([0.0, 0.05, 0.15])
    assert grown[2].predicted_speedup == pytest.approx(3.124 / (0.3 + 2.0 + 0.15))


def test_the_recommended_chain_length_is_measured(target, draft, tok, prompts):
    r = evaluate(target, tok, draft, prompts[:2], _cfg(measure_cost=True, gamma=4, measure_recommended=True),
                 progress=False)
    measured = r.cost_model["measured"]
    assert measured["name"] == r.cost_model["recommended"] and measured["speedup"] > 0
    gamma = next(s for s in r.cost_model["settings"] if s["name"] == measured["name"])["width"] - 1
    assert 0 < measured["mean_gamma"] <= gamma  # decoded at the recommended gamma (budget cuts shorten some rounds)
    assert gamma == 4 or measured["mean_gamma"] < r.mean_gamma
    assert f"Recommended: **{measured['name']}**" in markdown(r) and "measured" in markdown(r)
