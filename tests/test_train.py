"""The one loop on tiny models: recipes train, grad-accum invariance, exact resume, clear errors on bad input."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from specdistill.build import build
from specdistill.config import RECIPES_DIR
from specdistill.pipeline.run import build_components
from specdistill.train.checkpoint import list_checkpoints
from specdistill.train.loop import fit
from tests.conftest import compose, make_tiny_lm, make_tokenizer, tiny_overrides
from tests.test_recorded_losses import check_recorded

# moe_* recipes need an MoE target: tests/moe/ trains them on tiny Mixtral and Qwen3-MoE targets.
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if not p.stem.startswith("moe"))


def _run(recipe, tiny_target_dir, tiny_data_file, tmp_path, extra=(), name="run"):
    out = tmp_path / name
    cfg = compose(recipe, tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + list(extra))
    c = build_components(cfg)  # with the pipeline's regeneration stage (recipe eagle3_serve)
    return c, fit(c)


def _params(c):
    return {k: v.detach().clone() for k, v in c.accelerator.unwrap_model(c.models.draft).state_dict().items()}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_trains_and_writes_a_checkpoint(recipe, tiny_target_dir, tiny_data_file, tmp_path):
    c, res = _run(recipe, tiny_target_dir, tiny_data_file, tmp_path, ["trainer.lr=3e-3", "trainer.max_steps=3"])
    assert c.phases.main.steps == 3 and res.step == c.phases.total_steps  # draft_opd: its warm-up first
    losses = [h["train/loss"] for h in res.history]
    assert all(torch.isfinite(torch.tensor(losses)))
    check_recorded(recipe, losses)  # the same run, against its recorded losses (tests/test_recorded_losses.py)
    ck = res.final_checkpoint
    assert (ck / "draft" / "model.safetensors").exists() and (ck / "draft" / "config.json").exists()
    assert (ck / "draft" / "tokenizer.json").exists() and (ck / "config.yaml").exists()
    metrics = json.loads((ck / "metrics.json").read_text())
    assert 1.0 <= metrics["heldout/mean_accept_len"] <= 1 + c.eval.gamma
    # the saved HF draft reloads to the trained weights
    from specdistill.drafts import load_trained_draft
    reloaded = load_trained_draft(ck / "draft")
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, _params(c)[k]), k


def test_kd_lowers_the_loss(tiny_target_dir, tiny_data_file, tmp_path):
    _, res = _run("kd", tiny_target_dir, tiny_data_file, tmp_path,
                  ["trainer.lr=1e-2", "trainer.max_steps=12", "trainer.log_every=4", "trainer.warmup_steps=0"])
    first, last = res.history[0]["train/loss"], res.history[-1]["train/loss"]
    assert last < 0.7 * first, (first, last)


@pytest.mark.parametrize("recipe", ["kd", "sft"])
def test_grad_accum_1x8_equals_8x1(recipe, tiny_target_dir, tiny_data_file, tmp_path):
    common = ["trainer.max_steps=2", "trainer.lr=1e-2", "trainer.max_grad_norm=0"]
    a, _ = _run(recipe, tiny_target_dir, tiny_data_file, tmp_path, common + ["trainer.micro_batch_size=8",
                                                                                "trainer.grad_accum=1"], "a")
    b, _ = _run(recipe, tiny_target_dir, tiny_data_file, tmp_path, common + ["trainer.micro_batch_size=1",
                                                                                "trainer.grad_accum=8"], "b")
    pa, pb = _params(a), _params(b)
    init = _params(build(compose(recipe, tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "c",
                                                         tmp_path / "cache"))))
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=2e-5, rtol=1e-4), k
    assert any(not torch.equal(pa[k], init[k]) for k in pa)  # they did move


@pytest.mark.parametrize("deepspeed", [False, True], ids=["rescaled", "deepspeed_counts_first"])
def test_a_count_known_only_after_prepare_gives_the_same_weights(deepspeed, tiny_target_dir, tiny_data_file, tmp_path,
                                                                  monkeypatch):
    """An objective that counts its loss tokens only after prepare (on-policy, like Draft-OPD) is prepared and
    backpropagated one micro-batch at a time, its gradients rescaled by the global count after the last backward:
    the same weights as counting first, and never two micro-batches prepared at once. Under DeepSpeed (which steps
    inside the last backward) the step's micro-batches are all prepared first instead."""
    from specdistill.train import loop

    common = ["trainer.max_steps=2", "trainer.lr=1e-2", "trainer.max_grad_norm=0", "trainer.micro_batch_size=2",
              "trainer.grad_accum=4"]
    a, _ = _run("kd", tiny_target_dir, tiny_data_file, tmp_path, common, "a")
    c = build_components(compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "b",
                                                      tmp_path / "cache") + common))
    obj, order = c.objective, []
    prepare, loss = obj.prepare, obj.loss
    obj.num_tokens_before_prepare = lambda batch: None  # instance attributes shadow the protocol's methods
    obj.prepare = lambda batch, models: (order.append("prepare"), prepare(batch, models))[1]
    obj.loss = lambda prepared, models: (order.append("loss"), loss(prepared, models))[1]
    monkeypatch.setattr(loop, "_deepspeed", lambda acc: deepspeed)
    fit(c)
    assert order == (["prepare"] * 4 + ["loss"] * 4) * 2 if deepspeed else ["prepare", "loss"] * 8
    pa, pb = _params(a), _params(c)
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=1e-6, rtol=1e-5), k


def test_resume_equals_uninterrupted(tiny_target_dir, tiny_data_file, tmp_path):
    common = ["trainer.max_steps=6", "trainer.save_every=3", "trainer.keep_checkpoints=5", "trainer.lr=5e-3"]
    full, res = _run("kd", tiny_target_dir, tiny_data_file, tmp_path, common, "full")
    ckpts = list_checkpoints(tmp_path / "full")
    assert [p.name for p in ckpts] == ["step-0000003", "step-0000006"]
    # the resumed run loads its batches in the step (no prefetch thread): the same batches, the same weights
    resumed, res2 = _run("kd", tiny_target_dir, tiny_data_file, tmp_path,
                         common + [f"trainer.resume={ckpts[0]}", "trainer.prefetch_steps=0"], "resumed")
    assert res2.step == 6
    pf, pr = _params(full), _params(resumed)
    for k in pf:
        assert torch.allclose(pf[k], pr[k], atol=1e-6), k
    # trainer.resume=auto picks the newest complete checkpoint and ignores an interrupted save
    (tmp_path / "full" / "checkpoints" / ".step-0000009.tmp").mkdir()
    again, res3 = _run("kd", tiny_target_dir, tiny_data_file, tmp_path, common + ["trainer.resume=auto"], "full")
    assert res3.step == 6 and not res3.history  # nothing left to do
    # a fresh run pointed at a folder with checkpoints refuses instead of pruning them
    with pytest.raises(FileExistsError, match="resume=auto"):
        _run("kd", tiny_target_dir, tiny_data_file, tmp_path, common, "full")
    assert [p.name for p in list_checkpoints(tmp_path / "full")] == ["step-0000003", "step-0000006"]


def test_config_drift_separates_keys_that_break_exactness_from_harmless_ones():
    from omegaconf import OmegaConf

    from specdistill.train.checkpoint import config_drift

    base = {"target": {"path": "t", "aux_layer_ids": [1, 2, 3], "dtype": "float32"},
            "draft": {"init": "eagle3", "num_layers": 1, "draft_vocab_size": 64, "path": None},
            "data": {"path": "d.jsonl", "max_length": 64, "cache_dir": "/c"},
            "trainer": {"seed": 0, "micro_batch_size": 2, "grad_accum": 2, "max_steps": 3, "log_every": 1, "lr": 1e-3,
                        "output_dir": "out/a", "resume": None},
            "eval": {"gamma": 4}}
    same = OmegaConf.to_yaml(base)
    assert config_drift(same, same).changed == {}
    run = OmegaConf.create(base)
    run.trainer.resume, run.trainer.max_steps, run.trainer.log_every, run.trainer.output_dir = "x", 6, 2, "out/b"
    run.eval.gamma, run.trainer.lr, run.data.cache_dir, run.draft.path = 3, 2e-3, "/elsewhere", "warm"
    harmless = config_drift(same, OmegaConf.to_yaml(run))
    assert "trainer.resume" not in harmless.changed and harmless.changed["trainer.max_steps"] == (3, 6)
    assert set(harmless.changed) == {"trainer.max_steps", "trainer.log_every", "trainer.output_dir", "eval.gamma",
                                     "trainer.lr", "data.cache_dir", "draft.path"} and harmless.breaking == []
    for key, value in [("target.path", "other"), ("target.aux_layer_ids", [0, 1, 2]), ("draft.init", "config"),
                       ("draft.num_layers", 2), ("draft.draft_vocab_size", 32), ("data.path", "e.jsonl"),
                       ("data.max_length", 128), ("trainer.seed", 1), ("trainer.micro_batch_size", 4),
                       ("trainer.grad_accum", 1)]:
        changed = OmegaConf.create(base)
        OmegaConf.update(changed, key, value)
        assert config_drift(same, OmegaConf.to_yaml(changed)).breaking == [key], key


def test_resume_lists_config_drift_and_refuses_what_breaks_exactness(tiny_target_dir, tiny_data_file, tmp_path,
                                                                     capsys):
    common = ["trainer.max_steps=3", "trainer.save_every=3"]
    _, res = _run("kd", tiny_target_dir, tiny_data_file, tmp_path, common, "first")
    ckpt = res.final_checkpoint
    # longer, logged differently, evaluated differently: listed, then resumed
    capsys.readouterr()
    longer = [f"trainer.resume={ckpt}", "trainer.max_steps=4", "trainer.log_every=2", "eval.max_batches=1"]
    _, res2 = _run("kd", tiny_target_dir, tiny_data_file, tmp_path, longer, "longer")
    assert res2.step == 4
    said = capsys.readouterr().out
    assert "config differs" in said and "trainer.max_steps: 3 -> 4" in said and "eval.max_batches: 2 -> 1" in said
    assert "trainer.resume:" not in said
    # another micro-batch size (data order) and another draft depth (shapes): refused before any state is loaded
    with pytest.raises(ValueError, match=r"draft\.num_layers, trainer\.micro_batch_size differ") as err:
        _run("kd", tiny_target_dir, tiny_data_file, tmp_path, common + [f"trainer.resume={ckpt}", "draft.num_layers=2",
                                                                      "trainer.micro_batch_size=1"], "refused")
    assert "draft.num_layers=1 trainer.micro_batch_size=2" in str(err.value)  # the fix: the checkpoint's values
    assert "trainer.resume_allow_drift=true" in str(err.value)
    # asked for explicitly: a data-order change continues, with a warning
    capsys.readouterr()
    _, res3 = _run("kd", tiny_target_dir, tiny_data_file, tmp_path,
                   ["trainer.max_steps=4", f"trainer.resume={ckpt}", "trainer.micro_batch_size=1",
                    "trainer.resume_allow_drift=true"], "allowed")
    assert res3.step == 4 and "not exact" in capsys.readouterr().out


def test_checkpoint_weights_are_the_hf_draft(tiny_target_dir, tiny_data_file, tmp_path):
    c, res = _run("sft", tiny_target_dir, tiny_data_file, tmp_path, ["trainer.max_steps=1"])
    weights = load_file(res.final_checkpoint / "draft" / "model.safetensors")
    assert set(weights) >= {"model.embed_tokens.weight", "lm_head.weight"}


def test_missing_target_gives_a_clear_error(tiny_data_file, tmp_path):
    cfg = compose("kd", tiny_overrides(tmp_path / "nope", tiny_data_file, tmp_path / "o", tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build(cfg)


def test_tokenizer_mismatch_gives_a_clear_error(tiny_target_dir, tiny_data_file, tmp_path):
    other = tmp_path / "other_draft"
    tok = make_tokenizer(extra_words=("zebra", "quantum", "lattice") * 20)
    make_tiny_lm(len(tok), layers=1).save_pretrained(other)
    tok.save_pretrained(other)
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "o", tmp_path / "cache")
                  + ["draft=pretrained", f"draft.path={other}"])
    with pytest.raises(ValueError, match="vocab_size|tokenizer mismatch"):
        build(cfg)


def test_wandb_offline_logs_through_accelerate(tiny_target_dir, tiny_data_file, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    c, res = _run("kd", tiny_target_dir, tiny_data_file, tmp_path, ["trainer.max_steps=2", "trainer.wandb=true"], "wb")
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    lines = (tmp_path / "wb" / "metrics.jsonl").read_text().splitlines()
    assert any("train/loss" in line for line in lines)


def test_a_wall_time_budget_bounds_the_logged_eta(tiny_target_dir, tiny_data_file, tmp_path):
    """With trainer.max_minutes the run ends at the budget, not at its step count: the ETA it logs never exceeds the
    budget's time left, though its steps alone would take far longer."""
    budget_s = 3.0
    c, res = _run("kd", tiny_target_dir, tiny_data_file, tmp_path,
                  ["trainer.max_steps=100000", f"trainer.max_minutes={budget_s / 60}", "trainer.log_every=1"], "wall")
    assert 0 < res.step < 100000
    for h in res.history:
        assert h["eta_phase_s"] <= max(budget_s - h["wall_s"], 0.0) + 1e-6
        if h["step"] > 1:  # the first step, FLOP-counted, logs no rate (tests/test_profile.py)
            assert h["train/s_per_step"] * (100000 - h["step"]) > budget_s  # the steps' own ETA is far beyond it


def test_a_run_stopped_between_log_steps_logs_its_last_steps(tiny_target_dir, tiny_data_file, tmp_path):
    """A wall-time budget that ends the run before its first log step (log_every far beyond it): the steps it took
    are still logged, once, at the step where it stopped."""
    c, res = _run("kd", tiny_target_dir, tiny_data_file, tmp_path,
                  ["trainer.max_steps=100000", "trainer.max_minutes=0.05", "trainer.log_every=100000"], "stop")
    assert 0 < res.step < 100000
    lines = [json.loads(x) for x in (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "train/loss" in x]
    assert [x["step"] for x in train] == [res.step] and [h["step"] for h in res.history] == [res.step]
    assert math.isfinite(train[0]["train/loss"]) and train[0]["train/s_per_step"] > 0


def test_train_entry_runs_real_speculative_eval_at_epoch_end(tiny_target_dir, tiny_data_file, tmp_path):
    from specdistill.pipeline.run import run

    out = tmp_path / "spec"
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache")
                  + ["trainer.max_steps=2", "eval.spec_eval=true", "eval.prompts=heldout", "eval.num_prompts=2",
                     "eval.warmup_prompts=0", "eval.measure_cost=false"])
    res = run(cfg)
    metrics = json.loads((res.final_checkpoint / "metrics.json").read_text())
    assert 1.0 <= metrics["spec/mean_accept_len"] <= 1 + cfg.eval.gamma
    assert (out / "eval" / "epoch-0" / "results.json").exists()


def test_a_failing_epoch_end_hook_still_leaves_the_trained_checkpoint(tiny_target_dir, tiny_data_file, tmp_path):
    """An evaluation bug at the end of a long run must not cost the run: the checkpoint is written, then the error
    is raised."""
    def broken_eval(c, epoch, step):
        raise RuntimeError("evaluator exploded")

    c = build(compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "o", tmp_path / "cache")
                      + ["trainer.max_steps=2", "trainer.save_every=100"]))
    with pytest.raises(RuntimeError, match="exploded"):
        fit(c, epoch_end_hooks=(broken_eval,))
    assert [p.name for p in list_checkpoints(tmp_path / "o")] == ["step-0000002"]


def _toy_batches(n=40, micro=3, accum=2, seed=5):
    from specdistill.data.loader import StepBatches

    rows = [{"input_ids": list(range(1, 2 + i % 7)), "loss_mask": [1] * (1 + i % 7)} for i in range(n)]
    return StepBatches(rows, micro, accum, pad_id=0, seed=seed)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetched_batches_are_the_steps_own_in_order(depth):
    """The prefetch thread serves exactly StepBatches.micro_batches(step), step after step, from any start step (a
    resume), across epochs; a step asked out of order is an error, and a loading error surfaces at its step."""
    from specdistill.data.loader import Prefetcher

    sb = _toy_batches()
    for start in (0, 5):
        with Prefetcher(sb.micro_batches, start, 14, depth=depth) as pf:
            for step in range(start, 14):
                got, want = pf.get(step), _toy_batches().micro_batches(step)
                assert len(got) == len(want) == 2
                for g, w in zip(got, want):
                    assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)
    with Prefetcher(sb.micro_batches, 0, 14, depth=depth) as pf:
        with pytest.raises(RuntimeError, match="serves step 0 next, not step 1"):
            pf.get(1)

    def broken(step):
        if step == 2:
            raise OSError("truncated part")
        return sb.micro_batches(step)

    with Prefetcher(broken, 0, 14, depth=depth) as pf:
        pf.get(0), pf.get(1)
        with pytest.raises(OSError, match="truncated part"):
            pf.get(2)


def test_a_run_stopped_early_leaves_no_prefetch_thread():
    import threading

    from specdistill.data.loader import Prefetcher

    with Prefetcher(_toy_batches().micro_batches, 0, 1000, depth=2) as pf:
        pf.get(0)
    assert not any(t.name == "specdistill-prefetch" for t in threading.enumerate())


def test_a_sigterm_during_the_final_save_stops_after_it(tiny_target_dir, tiny_data_file, tmp_path, monkeypatch):
    """A preemption notice that lands while the last checkpoint is written: the checkpoint is whole, the run reports
    itself preempted (so the pipeline skips the final evaluation and exports), and a resume finishes it."""
    import os
    import signal

    from specdistill.pipeline.run import run
    from specdistill.train import loop

    real_save = loop._save

    def save_then_signal(c, s):
        saved = real_save(c, s)
        if s.step == c.phases.total_steps:
            os.kill(os.getpid(), signal.SIGTERM)
        return saved

    monkeypatch.setattr(loop, "_save", save_then_signal)
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + [
        "trainer.max_steps=2", "eval.spec_eval=true", "eval.spec_eval_at=end", "eval.prompts=heldout",
        "eval.num_prompts=2", "eval.warmup_prompts=0", "eval.measure_cost=false"]
    res = run(compose("kd", overrides))
    assert res.preempted == "SIGTERM" and res.step == 2
    assert list_checkpoints(out)[-1].name.endswith("2")
    assert not (out / "eval" / "final").exists()
    monkeypatch.setattr(loop, "_save", real_save)
    done = run(compose("kd", overrides + ["trainer.resume=auto"]))
    assert done.preempted is None
    assert (out / "eval" / "final" / "results.json").exists()
