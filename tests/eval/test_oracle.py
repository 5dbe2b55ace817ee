"""The oracle drafter (the target's greedy output replayed): every draft accepted, output identical to target-only
decoding, and eval.drafter=oracle reporting its speedup against (gamma+1) / v(gamma+1)."""
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.config import EvalConfig
from specdistill.decoding import speculative_generate, target_generate
from specdistill.decoding.drafters import OracleDrafter, Proposal
from specdistill.decoding.tree import TreeShape
from specdistill.eval.evaluator import evaluate
from specdistill.eval.report import write_report

from tests.conftest import left_padded_prompts


@pytest.fixture(scope="module")
def varied_target():
    """A tiny Llama whose greedy output changes token to token (init std 0.2: peaked, varied argmaxes), so a replay
    one token off is rejected."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                         initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


class OffByOneOracle(OracleDrafter):
    """A broken oracle: replays the continuation one token ahead of the row's offset."""

    def propose(self, shape, sampler):
        self.offset = self.offset + 1
        try:
            return super().propose(shape, sampler)
        finally:
            self.offset = self.offset - 1


def replay_violations(target, drafter: OracleDrafter, ids, mask, gamma: int, max_new: int, eos=None) -> list[str]:
    """What breaks the oracle's promise on one batch: a row-round (row active) accepting fewer than the round's
    drafts, or an output differing from target-only greedy decoding."""
    ref = target_generate(target, ids, mask, max_new_tokens=max_new, eos_token_id=eos)
    drafter.prepare(ids, mask)
    out = speculative_generate(target, drafter, ids, mask, strategy=gamma, max_new_tokens=max_new, eos_token_id=eos)
    bad = [f"round {i} row {b}: {int(r.num_accepted[b])} of {r.gamma} drafts accepted"
           for i, r in enumerate(out.rounds) for b in r.active.nonzero().flatten().tolist()
           if int(r.num_accepted[b]) != r.gamma]
    bad += [f"row {b}: output differs from target-only" for b in range(ids.shape[0]) if out.tokens(b) != ref.tokens(b)]
    return bad


@pytest.mark.parametrize("gamma", [1, 4])
def test_oracle_accepts_every_draft_and_matches_target_only(varied_target, gamma):
    ids, mask = left_padded_prompts([9, 5, 2, 7], seed=123)
    max_new = 3 * (gamma + 1) + 2  # full rounds, then one cut by the budget
    ref = target_generate(varied_target, ids, mask, max_new_tokens=max_new)
    assert any(len(set(ref.tokens(b))) > 2 for b in range(4))  # a varied replay: an offset error would be rejected
    assert replay_violations(varied_target, OracleDrafter(varied_target, max_new), ids, mask, gamma, max_new) == []
    drafter = OracleDrafter(varied_target, max_new)
    drafter.prepare(ids, mask)
    out = speculative_generate(varied_target, drafter, ids, mask, strategy=gamma, max_new_tokens=max_new)
    rounds = math.ceil(max_new / (gamma + 1))
    assert out.target_forwards.tolist() == [rounds] * 4  # gamma+1 tokens per round until the budget's last round
    assert [r.gamma for r in out.rounds[:-1]] == [gamma] * (rounds - 1)
    assert out.mean_accept_len == pytest.approx(max_new / rounds)
    whole = OracleDrafter(varied_target, gamma + 1)
    whole.prepare(ids[:1], mask[:1])
    one = speculative_generate(varied_target, whole, ids[:1], mask[:1], strategy=gamma, max_new_tokens=gamma + 1)
    assert one.mean_accept_len == gamma + 1  # tau == gamma + 1 exactly when no round is cut


def test_oracle_rows_ending_at_eos(varied_target):
    ids, mask = left_padded_prompts([6, 3, 8], seed=7)
    ref = target_generate(varied_target, ids, mask, max_new_tokens=20)
    eos = ref.tokens(0)[6]  # row 0 (and any row emitting it) ends mid-round
    assert replay_violations(varied_target, OracleDrafter(varied_target, 20), ids, mask, 4, 20, eos=eos) == []


def test_an_oracle_off_by_one_breaks_the_check(varied_target):
    ids, mask = left_padded_prompts([9, 5, 2, 7], seed=123)
    bad = replay_violations(varied_target, OffByOneOracle(varied_target, 17), ids, mask, 4, 17)
    assert any("drafts accepted" in b for b in bad)
    assert not any("differs" in b for b in bad)  # rejected drafts: still lossless


def test_oracle_refuses_unprepared_batches_and_trees(varied_target):
    ids, mask = left_padded_prompts([4, 6], seed=1)
    drafter = OracleDrafter(varied_target, 8)
    with pytest.raises(ValueError, match="not prepared"):
        speculative_generate(varied_target, drafter, ids, mask, strategy=2, max_new_tokens=8)
    drafter.prepare(ids, mask)
    with pytest.raises(ValueError, match="OracleDrafter proposes one token per position"):
        drafter.propose(TreeShape(2, 2), None)
    drafter.start(ids, mask)
    empty = TreeShape.chain(0)
    assert isinstance(drafter.propose(empty, None), Proposal) and drafter.propose(empty, None).tokens.shape == (2, 0)


def _cfg(**kw):
    base = dict(drafter="oracle", gamma=4, max_new_tokens=15, batch_size=1, batch_sizes=[1], warmup_prompts=1,
                ignore_eos=True, measure_cost=True)
    return EvalConfig(**(base | kw))


def test_eval_drafter_oracle_writes_the_overhead(target, tok, prompts, tmp_path):
    g = 4
    cfg = _cfg(gamma=g, max_new_tokens=2 * (g + 1))
    r = evaluate(target, tok, cfg.drafter, prompts, cfg, progress=False)
    assert r.drafter == "oracle" and r.greedy_mismatches == 0
    assert r.mean_accept_len == g + 1 and r.accept_rate_per_pos == [1.0] * g
    o = r.oracle
    assert o.gamma == g and o.tau == r.mean_accept_len
    assert o.speedup == r.speedup == pytest.approx(r.target_only_seconds / r.seconds)  # same tokens both ways
    assert o.v == r.cost.v == pytest.approx(o.verify_ms / o.target_step_ms) and o.v > 0
    assert o.bound == pytest.approx((g + 1) / o.v)
    assert o.efficiency == pytest.approx(r.speedup / o.bound)
    assert o.decode_efficiency == pytest.approx(r.decode_speedup / o.bound)
    write_report(r, tmp_path, plots=False)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["drafter"] == "oracle"
    for k in ("tau", "speedup", "v", "bound", "efficiency", "target_step_ms", "verify_ms"):
        assert data["oracle"][k] == pytest.approx(getattr(o, k))
    md = (tmp_path / "results.md").read_text()
    assert "## Oracle drafter" in md and f"v({g + 1})" in md and "efficiency = speedup / bound" in md
    assert r.flat()["spec/oracle_efficiency"] == pytest.approx(o.efficiency)


@pytest.mark.parametrize("change, message", [
    (dict(temperature=1.0), "eval.temperature=0"),
    (dict(dynamic_gamma=True), "unset eval.dynamic_gamma"),
    (dict(measure_cost=False), "eval.measure_cost=true"),
    (dict(tree={"topk": 2, "depth": 2}), "cannot grow token trees"),
])
def test_eval_oracle_refuses_what_it_cannot_measure(target, tok, prompts, change, message):
    from specdistill.config import TreeEvalConfig

    if "tree" in change:
        change = dict(tree=TreeEvalConfig(**change["tree"]))
    with pytest.raises(ValueError, match=message):
        evaluate(target, tok, "oracle", prompts[:1], _cfg(**change), progress=False)
