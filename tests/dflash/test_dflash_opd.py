"""Draft-OPD with DFlash drafts: the with-grad loss forward over rollout positions (branch rows and all) is the
drafter's block at each round, the objective trains, its kd_weight term is the tiled block loss, and `recipe=draft_opd
draft=dflash` warms up as recipe dflash_serve trains, then runs on-policy, resuming exactly across the hand-over."""

import json

import pytest
import torch

from specdistill.drafts import draft_adapter
from specdistill.drafts.dflash.adapter import dflash_logits_at
from specdistill.models.target import Target
from specdistill.objectives import Models
from specdistill.objectives.dflash import DFlashObjective
from specdistill.objectives.draft_opd import DraftOPDObjective
from specdistill.onpolicy.positions import AFTER_REJECTION
from specdistill.onpolicy.rollout import collect_rollout
from specdistill.pipeline.run import build_components, read_stages, run
from specdistill.train.checkpoint import list_checkpoints
from specdistill.train.loop import fit
from tests.conftest import compose, left_padded_prompts, tiny_overrides
from tests.dflash.conftest import tiny_dflash, tiny_target


@pytest.mark.parametrize("temperature, vd", [(0.0, None), (1.0, None), (1.0, 30)])
def test_loss_forward_is_the_drafters_block_at_every_position(temperature, vd):
    target = tiny_target()
    draft = tiny_dflash(target, 4, vocab=None if vd is None else torch.arange(48 - vd, 48))
    ids, mask = left_padded_prompts([7, 4, 6], seed=3)
    gen = torch.Generator().manual_seed(0) if temperature else None
    pos = collect_rollout(target, draft, ids, mask, gamma=3, max_new_tokens=14, temperature=temperature,
                          generator=gen, draft_policy="greedy")
    assert bool((pos.category == AFTER_REJECTION).any()) and pos.source is not None
    with torch.no_grad():
        q = dflash_logits_at(draft, pos.rows, pos.aux, pos.row, pos.context_len, pos.index, pos.source,
                             pos.source)                                                         # (P, V)
    # greedy drafting: every drafted token, after a rejection too, is the block's argmax at its position
    assert torch.equal(draft.draft_to_target(q.argmax(-1)), pos.token)
    alpha = draft_adapter(draft).alpha(pos.target.dense(), q, temperature, 0.0)
    torch.testing.assert_close(alpha, pos.alpha, atol=1e-4, rtol=0)


@pytest.mark.parametrize("group", [1, 2])
def test_blocks_in_groups_give_the_one_group_per_row_values_and_grads(group, monkeypatch):
    """dflash_logits_at runs a row's blocks in groups (drafts.base.group_size): forced to groups of 1 and 2 blocks,
    each over its row's context, the logits and the parameter gradients are those of one group per row."""
    import specdistill.drafts.dflash.adapter as adapter

    target = tiny_target()
    draft = tiny_dflash(target, 4)
    ids, mask = left_padded_prompts([7, 4, 6], seed=3)
    pos = collect_rollout(target, draft, ids, mask, gamma=3, max_new_tokens=14, temperature=1.0,
                          generator=torch.Generator().manual_seed(0), draft_policy="greedy")
    draft.train()
    w = torch.randn(len(pos), generator=torch.Generator().manual_seed(1))
    out = []
    for size in (None, group):  # None: one group per row
        monkeypatch.setattr(adapter, "group_size", lambda counts, keys, unit_slots=1, size=size: size or max(counts))
        draft.zero_grad()
        q = dflash_logits_at(draft, pos.rows, pos.aux, pos.row, pos.context_len, pos.index, pos.source, pos.source)
        (q.logsumexp(-1) * w).sum().backward()
        out.append((q.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-5, rtol=1e-5)
    assert out[0][1] and out[0][1].keys() == out[1][1].keys()
    for n in out[0][1]:
        torch.testing.assert_close(out[1][1][n], out[0][1][n], atol=1e-5, rtol=1e-4)


def test_objective_trains_a_dflash_draft_and_mixes_the_tiled_block_loss():
    model = tiny_target()
    draft = tiny_dflash(model, 4).train()
    models = Models(draft, Target(model, draft.config.aux_layer_ids))
    ids, mask = left_padded_prompts([7, 5], seed=4)
    batch = {"input_ids": ids.flip(1), "attention_mask": mask.flip(1), "loss_mask": mask.flip(1)}  # right-padded
    batch["loss_mask"][:, :3] = 0
    obj = DraftOPDObjective(gamma=3, max_new_tokens=8, temperature=1.0, kd_weight=0.5, replay=False)
    prep = obj.prepare(batch, models)
    out = obj.loss(prep, models)
    assert int(obj.num_tokens(prep)) == out.loss.numel()
    off = DFlashObjective().tiled(batch, models)
    assert off.loss.numel() == int(batch["loss_mask"][:, 1:].sum())  # every loss token once
    torch.testing.assert_close(out.loss[-off.loss.numel():], off.loss)
    (out.loss * out.weight).sum().backward()
    assert draft.fc.weight.grad is not None and bool(draft.fc.weight.grad.abs().sum() > 0)


RUN = ["draft=dflash", "draft.dflash.block_size=4", "warmup.steps=3", "warmup.epochs=null",
       "warmup.micro_batch_size=2", "warmup.warmup_steps=1", "trainer.max_steps=3", "trainer.save_every=2",
       "trainer.keep_checkpoints=10", "trainer.lr=5e-3", "objective.max_new_tokens=6", "objective.gamma=3",
       "objective.replay_ratio=0.5", "trainer.measure_roofline=false"]


def _weights(checkpoint):
    from safetensors.torch import load_file

    return load_file(checkpoint / "draft" / "model.safetensors")


@pytest.fixture(scope="module")
def full_run(tiny_target_dir, tiny_data_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_opd")
    dirs = (tiny_target_dir, tiny_data_file, root)
    cfg = compose("draft_opd", tiny_overrides(tiny_target_dir, tiny_data_file, root / "full", root / "cache") + RUN)
    res = run(cfg)
    return res, dirs


def test_draft_opd_with_dflash_warms_up_as_dflash_serve_then_runs_on_policy(full_run):
    res, (target, data, root) = full_run
    states = [json.loads((p / "trainer_state.json").read_text()) for p in list_checkpoints(root / "full")]
    assert [(s["step"], s["phase"]) for s in states] == [(2, "warmup"), (3, "warmup"), (4, "main"), (6, "main")]
    assert res.step == 6 and all(torch.isfinite(torch.tensor(h["train/loss"])) for h in res.history)
    # the recipe's exports: the DFlash layout for vLLM; sglang (EAGLE-3 only) skipped
    assert set(read_stages(root / "full")) == {"export/vllm"}
    # recipe=dflash_serve end to end (regenerate -> train -> final spec eval -> vLLM export) for the warm-up's steps
    serve = compose("dflash_serve", tiny_overrides(target, data, root / "serve", root / "cache") + [
        "draft.dflash.block_size=4", "trainer.epochs=null", "trainer.max_steps=3", "trainer.grad_accum=1",
        "trainer.lr=1e-3", "trainer.measure_roofline=false", "eval.spec_eval=true", "eval.gamma=3"])
    served = run(serve)
    assert json.loads((root / "serve" / "export" / "vllm" / "config.json").read_text())["block_size"] == 4
    assert set(read_stages(root / "serve")) == {"eval/final", "export/vllm"}
    assert any((root / "serve" / "eval" / "final").iterdir())  # the DFlash drafter's real speculative evaluation
    want = _weights(served.final_checkpoint)
    got = _weights(next(p for p in list_checkpoints(root / "full") if p.name == "step-0000003"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("at", [2, 3, 4], ids=["inside_warmup", "at_hand_over", "after_hand_over"])
def test_resume_equals_uninterrupted_across_the_hand_over(at, full_run):
    full, (target, data, root) = full_run
    ckpt = next(p for p in list_checkpoints(root / "full") if p.name == f"step-{at:07d}")
    resumed = build_components(compose("draft_opd", tiny_overrides(target, data, root / f"resumed_{at}", root / "cache")
                                       + RUN + [f"trainer.resume={ckpt}"]))
    res = fit(resumed)
    assert res.step == 6
    want, got = _weights(full.final_checkpoint), _weights(res.final_checkpoint)
    changed = {k: float((want[k] - got[k]).abs().max()) for k in want if not torch.equal(want[k], got[k])}
    assert not changed, changed
