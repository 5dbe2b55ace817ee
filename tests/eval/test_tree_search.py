"""The cost model's tree search: replaying a candidate's expansion on a probe tree gives the candidate's own tree, and
eval.measure_recommended names the setting of highest predicted speed, decodes it once and reports predicted against
measured (chains only, said so, for drafters that cannot score alternatives: n-gram lookup; a block drafter's trees
no deeper than its block)."""
from types import SimpleNamespace

import pytest
import torch

from specdistill.config import EvalConfig, TreeEvalConfig
from specdistill.decoding.tree import TreeShape, grow
from specdistill.eval.evaluator import evaluate
from specdistill.eval.report import markdown
from specdistill.eval.tree_cost import VerifyCurve
from specdistill.eval.tree_search import probe_trees, replay, tree_settings

V = 12


def _markov(seed: int):
    """A draft whose logits after a node depend on the node's token and depth only, and a target likewise: trees are
    then determined by tokens, so a candidate grown for real can be compared with its replay on a probe tree."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(8, V, V, generator=g) * 2.0           # [depth, token] -> logits
    target = (torch.randn(8, V + 1, V, generator=g) * 2.0).softmax(-1)  # [depth, parent token (V: the root)] -> p
    return draft, target


def _grow(shape: TreeShape, draft, root: torch.Tensor):
    """grow() with the Markov draft: root (B,) tokens."""
    def feed(tokens, visible, d, parent):
        return draft[d][tokens]                                  # (B, k, V)
    return grow(shape, draft[0][root], feed)


def _reach(tree, target, root):
    """(B, N+1) probability that verification reaches each node under the Markov target, and node_prob (B, N)."""
    tokens = torch.nn.functional.pad(tree.tokens, (1, 0), value=V)      # the root's token column: V
    parent_tok = tokens.gather(1, tree.parents)                          # (B, N)
    prob = target[tree.depth - 1, parent_tok, tree.tokens]               # (B, N)
    R = torch.ones(tree.tokens.shape[0], tree.num_nodes + 1)
    for _ in range(tree.max_depth):
        R = torch.cat([R[:, :1], prob * R.gather(1, tree.parents)], dim=1)
    return R, prob


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_replayed_candidate_is_the_candidate_grown_for_real(seed):
    draft, target = _markov(seed)
    B, D = 16, 4
    root = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(seed))
    probe_shape = TreeShape(4, D)
    probe = _grow(probe_shape, draft, root)
    _, prob = _reach(probe, target, root)
    rounds = [SimpleNamespace(proposal=probe, node_prob=prob, active=torch.ones(B, dtype=bool))]
    trees = probe_trees(probe_shape, rounds)
    assert trees.rounds == B
    checked = 0
    for k in (1, 2, 3, 4):
        rep = replay(trees, k)
        for d in range(1, D + 1):
            accepted = rep.accepted(d)
            if k == 4:
                assert rep.coverage(d) == 1.0  # the probe's own pool
            if rep.coverage(d) < 1.0:
                continue
            for n in sorted({1, 3, rep.pool(d) // 2, rep.pool(d)} & set(range(1, rep.pool(d) + 1))):
                shape = TreeShape(k, d, None if n == rep.pool(d) else n)
                real = _grow(shape, draft, root)
                R, _ = _reach(real, target, root)
                assert accepted[n - 1].item() == pytest.approx(R[:, 1:].sum(1).mean().item(), rel=1e-5), shape
                checked += 1
    assert checked > 20


def test_tree_settings_pick_the_node_count_of_highest_predicted_speed():
    draft, target = _markov(3)
    root = torch.arange(V).repeat(2)
    probe = _grow(TreeShape(4, 3), draft, root)
    _, prob = _reach(probe, target, root)
    trees = probe_trees(TreeShape(4, 3), [SimpleNamespace(proposal=probe, node_prob=prob,
                                                          active=torch.ones(len(root), dtype=bool))])
    curve = VerifyCurve(10.0, [10.0 + 0.5 * k for k in range(32)], 5)
    settings = tree_settings(trees, lambda k, d: 0.1 * d, curve, overhead=0.2, baseline=1.1)
    assert len(settings) == 4 * 3 and all(s.width <= 32 for s in settings)
    for s in settings:
        rep = replay(trees, s.shape.topk)
        n = s.shape.size
        assert s.tau == pytest.approx(1 + rep.accepted(s.shape.depth)[n - 1].item())
        assert s.predicted_speedup == pytest.approx(s.tau * 1.1 / (0.1 * s.shape.depth + curve.v(n + 1) + 0.2))
        assert s.flags["--speculative-num-draft-tokens"] == n + 1


def _cfg(**kw):
    base = dict(gamma=3, max_new_tokens=16, batch_size=1, batch_sizes=[1], warmup_prompts=1, ignore_eos=True,
                measure_cost=True, measure_recommended=True, tree=TreeEvalConfig(probe_prompts=2, search_depth=3))
    return EvalConfig(**(base | kw))


def test_the_recommended_setting_is_searched_over_chains_and_trees_and_measured(target, draft, tok, prompts):
    logs = []
    r = evaluate(target, tok, draft, prompts[:3], _cfg(), progress=False, log=logs.append)
    m = r.cost_model
    names = [s["name"] for s in m["settings"]]
    assert names[:3] == ["chain1", "chain2", "chain3"] and len(names) == 3 + 4 * 3  # best node count per topk, depth
    assert m["recommended"] == max(m["settings"], key=lambda s: s["predicted_speedup"])["name"]
    assert m["recommended_sglang"]["--speculative-eagle-topk"] in (1, 2, 3, 4)
    measured = m["measured"]
    assert measured["name"] == m["recommended"] and measured["decode_speedup"] > 0
    assert measured["ratio"] == pytest.approx(measured["decode_speedup"] / measured["predicted_speedup"])
    assert measured["within_10pct"] == (abs(measured["ratio"] - 1) <= 0.1)
    assert measured["at_least_main"] == (measured["speedup"] >= r.speedup)
    if measured["decoded"]:
        assert measured["greedy_mismatches"] == 0
    assert m["main"]["name"] == "chain3" and any(n.startswith("trees searched") for n in m["notes"])
    # the chains' bookkeeping is a line through a chain-1 probe and the measured pass (chain 3)
    assert any(n.startswith("chains: bookkeeping per round") for n in m["notes"])
    o = [s["overhead"] for s in m["settings"][:3]]
    if min(o) > 0:
        assert o[1] == pytest.approx((o[0] + o[2]) / 2)
    md = markdown(r)
    assert f"Recommended: **{m['recommended']}** (SGLang: `--speculative-eagle-topk" in md
    assert "ratio" in md and ("within 10%" in md or "off by more than 10%" in md)
    assert any("[eval] cost model: recommended" in line for line in logs)
    # the loggers' and the model card's view: the recommended setting with the SGLang flags that serve it
    flat = r.flat("spec/")
    flags = m["recommended_sglang"]
    assert flat["spec/recommended_speedup"] == measured["speedup"]
    assert flat["spec/recommended_eagle_topk"] == flags["--speculative-eagle-topk"]
    assert flat["spec/recommended_num_draft_tokens"] == flags["--speculative-num-draft-tokens"]
    from specdistill.drafts import Eagle3Draft
    from specdistill.hub.card import tau_table

    line = tau_table(flat, gamma=3, serves_trees=Eagle3Draft.serves_trees).splitlines()
    line = next(x for x in line if x.startswith("Recommended by the cost model"))
    assert f"--speculative-num-draft-tokens {flags['--speculative-num-draft-tokens']}`" in line
    assert f"Measured {measured['speedup']:.3f}x" in line


def test_without_probes_every_chain_gets_the_measured_pass_bookkeeping(target, draft, tok, prompts):
    r = evaluate(target, tok, draft, prompts[:2], _cfg(tree=TreeEvalConfig(probe_prompts=0)), progress=False)
    m = r.cost_model
    assert [s["name"] for s in m["settings"]] == ["chain1", "chain2", "chain3"]
    assert len({s["overhead"] for s in m["settings"]}) == 1
    assert not any(n.startswith("chains: bookkeeping") for n in m["notes"])


def test_a_tree_run_searches_trees_only(target, draft, tok, prompts):
    r = evaluate(target, tok, draft, prompts[:2], _cfg(tree=TreeEvalConfig(topk=2, depth=2, probe_prompts=1,
                                                                          search_depth=2)), progress=False)
    m = r.cost_model
    assert all(s["name"].startswith("tree") for s in m["settings"]) and m["main"]["name"] == "tree2x2"
    assert m["measured"]["name"] == m["recommended"]


def test_drafters_that_cannot_score_alternatives_get_chain_lengths_and_say_so(target, tok, prompts):
    r = evaluate(target, tok, "ngram", prompts[:2], _cfg(), progress=False)
    m = r.cost_model
    assert [s["name"] for s in m["settings"]] == ["chain1", "chain2", "chain3"]
    assert any("NGramDrafter cannot score alternatives" in n for n in m["notes"])
    assert "Note: trees not searched" in markdown(r)


def test_a_dflash_draft_searches_trees_no_deeper_than_its_block():
    from tests.conftest import make_tokenizer
    from tests.dflash.conftest import tiny_dflash, tiny_target

    tok = make_tokenizer()
    target = tiny_target()
    target.resize_token_embeddings(len(tok))
    draft = tiny_dflash(target, 3)  # 2 draft positions per round: the search is cut to depth 2 (asked: 3)
    msgs = [[{"role": "user", "content": "tell me about the cat and the dog"}]]
    r = evaluate(target, tok, draft, msgs, _cfg(gamma=2), progress=False)
    m = r.cost_model
    chains = [s for s in m["settings"] if s["name"].startswith("chain")]
    trees = [s for s in m["settings"] if s["name"].startswith("tree")]
    assert [s["name"] for s in chains] == ["chain1", "chain2"]
    assert trees and max(s["depth"] for s in trees) == 2 and {2, 3, 4} <= {s["topk"] for s in trees}
    assert any(n.startswith("trees searched to depth 2: the drafter proposes at most 2") for n in m["notes"])
    assert m["measured"]["name"] == m["recommended"]
    # a block drafter's round costs one forward whatever the length: its draft cost is not length-proportional
    assert chains[0]["draft"] > chains[1]["draft"] / 2


def test_bad_search_settings_are_refused_by_name(target, tok, prompts):
    with pytest.raises(ValueError, match="eval.tree.search_depth"):
        evaluate(target, tok, "target", prompts, _cfg(tree=TreeEvalConfig(search_depth=17)), progress=False)
    with pytest.raises(ValueError, match="eval.tree.probe_prompts"):
        evaluate(target, tok, "target", prompts, _cfg(tree=TreeEvalConfig(probe_prompts=-1)), progress=False)


def test_a_budget_too_short_for_the_probe_skips_trees_and_says_so(target, draft, tok, prompts):
    r = evaluate(target, tok, draft, prompts[:1], _cfg(max_new_tokens=3), progress=False)
    m = r.cost_model
    assert [s["name"] for s in m["settings"]] == ["chain1", "chain2", "chain3"]
    assert any("cut short by eval.max_new_tokens=3" in n for n in m["notes"])


def test_the_summary_line_predicts_the_decoded_setting_from_the_cost_model(target, draft, tok, prompts):
    from specdistill.eval.run import summary_line

    for tree in (TreeEvalConfig(topk=2, depth=2, probe_prompts=0), TreeEvalConfig(probe_prompts=0)):
        r = evaluate(target, tok, draft, prompts[:1], _cfg(tree=tree, measure_recommended=False), progress=False)
        name = r.tree["name"] if r.tree else "chain3"
        want = next(s["predicted_speedup"] for s in r.cost_model["settings"] if s["name"] == name)
        assert f"predicted {want:.3f}x (cost model" in summary_line(r)
        assert "Leviathan" not in summary_line(r)


@pytest.mark.parametrize("predicted, measured, slower", [(1.05, 1.03, False), (0.96, 0.93, True), (1.02, 0.98, True)])
def test_a_draft_slower_than_the_target_alone_is_said_so(predicted, measured, slower):
    from specdistill.eval.tree_cost import Setting, VerifyCurve, cost_model_markdown, cost_model_report

    curve = VerifyCurve(step_ms=10.0, ms=[11.0, 12.0], context_tokens=5)
    m = cost_model_report(curve, [Setting("chain1", 1.2, 0.1, 2, 1.1, gamma=1)])
    m["recommended_predicted_speedup"] = predicted
    m["measured"] = {"name": "chain1", "speedup": measured, "decode_speedup": measured, "mean_accept_len": 1.2,
                     "predicted_speedup": predicted, "ratio": measured / predicted, "within_10pct": True}
    text = "\n".join(cost_model_markdown(m))
    assert ("**Slower than the target alone**" in text) == slower
    if slower:
        assert f"measured {measured:.3f}x; serve without this draft here" in text
