"""The block size sweep (eval.block_sizes): one evaluation per block size B with gamma = B - 1, its timed costs, and the
fastest B named; through the evaluator CLI's run() too, refused for drafters without a block size."""

import json

import pytest

from specdistill.config import EvalConfig
from specdistill.eval.block_sweep import block_size_sweep
from specdistill.eval.run import run
from tests.conftest import compose, make_tokenizer
from tests.dflash.conftest import tiny_dflash, tiny_target

PROMPTS = [[{"role": "user", "content": "tell me about the cat and the dog"}],
           [{"role": "user", "content": "what is one two three"}]]


def test_block_sizes_are_each_evaluated_and_the_fastest_named():
    tok = make_tokenizer()
    target = tiny_target()
    target.resize_token_embeddings(len(tok))
    draft = tiny_dflash(target, 16)
    cfg = EvalConfig(max_new_tokens=12, batch_size=1, batch_sizes=[1], warmup_prompts=0, ignore_eos=True)
    sweep = block_size_sweep(target, tok, draft, PROMPTS, cfg, [4, 8, 16], progress=False, log=lambda s: None)
    assert [p.block_size for p in sweep.points] == [4, 8, 16]
    for p in sweep.points:
        assert p.greedy_mismatches == 0 and 1.0 <= p.mean_accept_len <= p.block_size
        assert len(p.accept_rate_per_pos) == p.block_size - 1
        assert p.draft_ms_per_round > 0 and p.verify_ms > 0 and p.target_step_ms > 0
    assert sweep.fastest == max(sweep.points, key=lambda p: p.tokens_per_s).block_size
    assert f"B = {sweep.fastest}" in sweep.markdown()
    assert draft.config.block_size == 16  # the sweep's views share the draft's weights, not its block size


def _overrides(target_dir, prompts, out, *extra):
    return [f"target.path={target_dir}", f"eval.prompts={prompts}", "target.dtype=float32", "draft=dflash",
            "draft.num_layers=1",
            "eval.num_prompts=1", "eval.max_new_tokens=6", f"eval.output_dir={out}", "eval.batch_size=1",
            "eval.batch_sizes=[1]", "eval.warmup_prompts=0", "eval.gamma=3", "eval.measure_cost=false",
            *extra]


def test_the_evaluator_writes_the_sweep_and_refuses_drafters_without_blocks(tiny_target_dir, tiny_data_file, tmp_path):
    def over(name, *extra):
        return compose(None, _overrides(tiny_target_dir, tiny_data_file, tmp_path / name, *extra))

    r, _ = run(over("a", "eval.block_sizes=[4,8]"), log=lambda s: None)
    assert r.drafter == "dflash" and r.greedy_mismatches == 0
    data = json.loads((tmp_path / "a" / "block_sweep.json").read_text())
    assert [p["block_size"] for p in data["points"]] == [4, 8] and data["fastest_block_size"] in (4, 8)
    assert (tmp_path / "a" / "block_sweep.md").exists()
    with pytest.raises(ValueError, match="block_sizes"):
        run(over("b", "eval.block_sizes=[4]", "eval.drafter=ngram"), log=lambda s: None)
    with pytest.raises(ValueError, match="block_sizes"):
        run(over("c", "eval.block_sizes=[4]", "draft=from_target"), log=lambda s: None)
