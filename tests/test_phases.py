"""recipe=draft_opd as one run of two phases (specdistill/phases.py): an off-policy EAGLE-3 warm-up, then the on-policy
phase. Resume is exact inside either phase and across the hand-over; the LR restarts per phase; metrics record the
phase; draft.path skips the warm-up; bad phase settings fail before anything is loaded."""
import json
import math

import pytest
import torch

from specdistill.phases import Phase, PhasePlan, cosine_with_warmup, warmup_runs
from specdistill.pipeline.run import build_components
from specdistill.train.checkpoint import list_checkpoints
from specdistill.train.loop import fit
from tests.conftest import compose, tiny_overrides

# 3 warm-up steps (global 0-2), then 3 on-policy steps (3-5); checkpoints at 2 (inside the warm-up), 3 (the
# hand-over, always written), 4 (inside the on-policy phase) and 6 (the end). Rollouts sample (temperature 1), so the
# on-policy steps after a resume match only if the rollout RNG, replay buffer and data position were restored.
# Weights are compared to the bit: without the roofline count, whose first step of each run runs under torch's
# FlopCounterMode and so differs from an uncounted step by float rounding (~1e-8).
RUN = ["warmup.steps=3", "warmup.epochs=null", "warmup.micro_batch_size=2", "warmup.warmup_steps=1",
       "warmup.schedule_steps=null",
       "trainer.max_steps=3", "trainer.save_every=2", "trainer.keep_checkpoints=10", "trainer.lr=5e-3",
       "objective.max_new_tokens=6", "objective.gamma=2", "objective.replay_ratio=0.5", "trainer.export_formats=[]",
       "trainer.measure_roofline=false"]


def _cfg(dirs, name, extra=()):
    target, data, root = dirs
    return compose("draft_opd", tiny_overrides(target, data, root / name, root / "cache") + RUN + list(extra))


def _weights(c):
    return {k: v.detach().clone() for k, v in c.accelerator.unwrap_model(c.models.draft).state_dict().items()}


@pytest.fixture(scope="module")
def full_run(tiny_target_dir, tiny_data_file, tmp_path_factory):
    """The uninterrupted run: (its components, its FitResult, (target, data, root) for more runs)."""
    dirs = (tiny_target_dir, tiny_data_file, tmp_path_factory.mktemp("phases"))
    c = build_components(_cfg(dirs, "full"))
    return c, fit(c), dirs


def test_the_plan_is_a_warmup_then_the_objective(full_run):
    c, res, _ = full_run
    assert [(p.name, p.objective.name, p.start, p.steps) for p in c.phases.phases] == [
        ("warmup", "eagle3", 0, 3), ("main", "draft_opd", 3, 3)]
    assert res.step == 6
    # both phases read the regenerated store (features for the warm-up, prompts for the rollouts)
    assert all(p.batches.dataset is c.data.train for p in c.phases.phases)


@pytest.mark.parametrize("at", [2, 3, 4], ids=["inside_warmup", "at_hand_over", "after_hand_over"])
def test_resume_equals_uninterrupted_across_the_hand_over(at, full_run):
    full, _, dirs = full_run
    ckpt = next(p for p in list_checkpoints(dirs[2] / "full") if p.name == f"step-{at:07d}")
    resumed = build_components(_cfg(dirs, f"resumed_{at}", [f"trainer.resume={ckpt}"]))
    res = fit(resumed)
    assert res.step == 6
    want, got = _weights(full), _weights(resumed)
    changed = {k: float((want[k] - got[k]).abs().max()) for k in want if not torch.equal(want[k], got[k])}
    assert not changed, changed
    # the on-policy state too: the replay buffer holds the same positions with the same priorities
    a, b = full.objective.state.buffer, resumed.objective.state.buffer
    assert len(a) == len(b) > 0 and torch.equal(a.priorities(), b.priorities())


def test_the_warmup_is_the_serving_recipes_training(full_run):
    """recipe=eagle3_serve, run for the warm-up's 3 steps on the same data, ends with the hand-over head to the bit: the
    warm-up is that recipe's training (data order, objective, batches, optimizer, LR), so a draft.path to its head is
    the same start as the warm-up."""
    from safetensors.torch import load_file

    _, _, (target, data, root) = full_run
    serve = compose("eagle3_serve", tiny_overrides(target, data, root / "serve", root / "cache") + [
        "trainer.epochs=null", "trainer.max_steps=3", "trainer.grad_accum=1", "trainer.measure_roofline=false"])
    res = fit(build_components(serve))
    hand_over = next(p for p in list_checkpoints(root / "full") if p.name == "step-0000003")
    want = load_file(res.final_checkpoint / "draft" / "model.safetensors")
    got = load_file(hand_over / "draft" / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_checkpoints_and_metrics_record_the_phase(full_run):
    c, res, dirs = full_run
    out = dirs[2] / "full"
    states = {p.name: json.loads((p / "trainer_state.json").read_text()) for p in list_checkpoints(out)}
    assert [(s["step"], s["phase"], s["phase_step"]) for s in states.values()] == [
        (2, "warmup", 2), (3, "warmup", 3), (4, "main", 1), (6, "main", 3)]
    assert states["step-0000003"]["phases"] == c.phases.describe()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "train/loss" in x]
    assert [(x["step"], x["phase"], x["phase_step"]) for x in train] == [
        (1, "warmup", 1), (2, "warmup", 2), (3, "warmup", 3), (4, "main", 1), (5, "main", 2), (6, "main", 3)]
    # each phase logs its own objective's metrics and its own ETA, which reaches 0 at the phase's end
    assert all(("train/acc_step0" in x) == (x["phase"] == "warmup") for x in train)
    assert all(("train/rollout_tau" in x) == (x["phase"] == "main") for x in train)
    assert [x["eta_phase_s"] == 0 for x in train] == [False, False, True, False, False, True]
    # held-out acceptance at the hand-over and at the end, each line naming its phase
    held = [(x["step"], x["phase"]) for x in lines if "heldout/mean_accept_len" in x]
    assert held == [(3, "warmup"), (6, "main")]


def test_lr_restarts_at_the_hand_over(full_run):
    """The logged learning rate of each step is its phase's: a linear ramp to the phase's lr, then cosine decay."""
    c, res, dirs = full_run
    lrs = [x["train/lr"] for x in res.history if "train/lr" in x]
    w, m = c.phases.phases
    assert lrs[0] == 0.0 and lrs[3] == 0.0  # each phase's first step: the start of its warm-up ramp
    assert lrs[1] == pytest.approx(w.lr) and lrs[4] == pytest.approx(m.lr)
    assert lrs == pytest.approx([p.lr_at(s) for s in range(6) for p in [c.phases.at(s)]])


def _fake_batches(n_rows, mbs):
    from specdistill.data.loader import StepBatches

    return StepBatches([{"input_ids": [1], "loss_mask": [0]}] * n_rows, mbs, 1, 0)


class _Named:
    def __init__(self, name):
        self.name = name


def test_one_phase_schedule_is_transformers_cosine():
    """A single phase's LR factors are those of transformers' get_cosine_with_min_lr_schedule_with_warmup, to the
    bit, at every step (runs that predate phases resume onto the same schedule)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    ref = get_cosine_with_min_lr_schedule_with_warmup(opt, 7, 50, min_lr_rate=0.1)
    plan = PhasePlan([Phase("main", _Named("kd"), _fake_batches(8, 1), 0, 40, 3e-4, 7, 50, 0.1)], base_lr=3e-4)
    want = [ref.lr_lambdas[0](s) for s in range(60)]
    assert [plan.lr_factor(s) for s in range(60)] == want
    assert [cosine_with_warmup(s, 7, 50, 0.1) for s in range(60)] == want


def test_two_phase_plan_steps_epochs_and_lr():
    w = Phase("warmup", _Named("eagle3"), _fake_batches(10, 4), 0, 5, 1e-3, 2, 5, 0.1)  # 2 steps per epoch
    m = Phase("main", _Named("draft_opd"), _fake_batches(10, 1), 5, 4, 2e-4, 1, 4, 0.1, epoch_offset=w.epochs)
    plan = PhasePlan([w, m], base_lr=2e-4)
    assert [plan.at(s).name for s in range(10)] == ["warmup"] * 5 + ["main"] * 5  # past the end: the last phase
    assert plan.total_steps == 9 and w.epochs == 3
    assert [plan.epoch_of(s) for s in range(9)] == [0, 0, 1, 1, 2, 3, 3, 3, 3]
    assert [w.epoch_done(s) for s in (1, 2, 4, 5)] == [False, True, True, True]  # its epochs, and its own end
    factors = [plan.lr_factor(s) * plan.base_lr for s in range(9)]
    assert factors[:3] == pytest.approx([0, 5e-4, 1e-3])  # ramp to the warm-up's lr
    assert factors[5:7] == pytest.approx([0, 2e-4])  # the restart: ramp to the on-policy lr
    assert factors[4] < factors[2] and factors[8] < factors[6]  # each decays within its own phase
    with pytest.raises(ValueError, match=">= 1 step"):
        PhasePlan([Phase("warmup", _Named("eagle3"), _fake_batches(10, 4), 0, 0, 1e-3, 2, 5, 0.1)], base_lr=1e-3)


def test_draft_path_skips_the_warmup(full_run):
    """A trained head (here the hand-over checkpoint's) at draft.path: one phase, the on-policy one."""
    _, _, dirs = full_run
    head = next(p for p in list_checkpoints(dirs[2] / "full") if p.name == "step-0000003") / "draft"
    from specdistill.drafts import load_trained_draft

    c = build_components(_cfg(dirs, "warm", [f"draft.path={head}", "trainer.max_steps=1"]))
    assert [p.name for p in c.phases.phases] == ["main"] and c.phases.total_steps == 1
    saved = load_trained_draft(head).state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in _weights(c).items())  # it starts from the head, not from scratch
    assert fit(c).step == 1


def test_resume_into_another_plan_is_refused(full_run):
    """draft.path is harmless to a resume, except when it removes the warm-up (warmup.mode=auto): then step s would
    train another objective on other data, and the resume says so."""
    _, _, dirs = full_run
    ckpt = next(p for p in list_checkpoints(dirs[2] / "full") if p.name == "step-0000002")
    c = build_components(_cfg(dirs, "other", [f"trainer.resume={ckpt}", f"draft.path={ckpt / 'draft'}"]))
    with pytest.raises(ValueError, match="training phases"):
        fit(c)


BAD = [
    (["warmup.objective.name=nope"], "unknown objective warmup.objective.name='nope'"),
    (["warmup.steps=4"], "exactly one of warmup.steps"),
    (["warmup.epochs=null"], "exactly one of warmup.steps"),
    (["warmup.epochs=0"], "warmup.epochs=0 must be >= 1"),
    (["warmup.steps=0", "warmup.epochs=null"], "warmup.steps=0 must be >= 1"),
    (["warmup.mode=sometimes"], "warmup.mode='sometimes'"),
    (["warmup.mode=always", "draft.path=__HEAD__"], "warmup.mode=always with draft.path"),
    (["draft=from_target"], "cannot train draft.init='from_target'"),
    (["+warmup.objective.stepz=3"], "bad warmup.objective config for 'eagle3'"),
    (["objective.assist=false"], "objective.assist=false (draft-only rollouts) needs a draft that decodes alone"),
]


@pytest.mark.parametrize("extra, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_phase_settings_fail_before_anything_is_loaded(extra, message, tiny_target_dir, tiny_data_file, tmp_path,
                                                           monkeypatch):
    import re

    from specdistill import build as build_module

    def no_loading(cfg):
        raise AssertionError("the target was loaded before the bad phase settings were refused")

    monkeypatch.setattr(build_module, "build_target", no_loading)
    head = tmp_path / "head"
    head.mkdir()
    cfg = compose("draft_opd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "o", tmp_path / "cache")
                  + [e.replace("__HEAD__", str(head)) for e in extra])
    with pytest.raises(ValueError, match=re.escape(message)):
        build_components(cfg)


def test_warmup_modes():
    from omegaconf import OmegaConf

    def cfg(mode, path):
        return OmegaConf.create({"warmup": {"mode": mode}, "draft": {"init": "eagle3", "path": path}})

    assert [warmup_runs(cfg(m, None)) for m in ("never", "auto", "always")] == [False, True, True]
    assert [warmup_runs(cfg(m, "x")) for m in ("never", "auto", "always")] == [False, False, True]
    # an init that does not read draft.path (a draft built from the target) warms up under auto
    assert warmup_runs(OmegaConf.create({"warmup": {"mode": "auto"}, "draft": {"init": "from_target", "path": "x"}}))


def test_one_command_reuses_the_serving_recipes_store_and_ends_served(tiny_target_dir, tiny_data_file, tmp_path):
    """recipe=draft_opd as a user runs it, after recipe=eagle3_serve regenerated its data: the warm-up reads that very
    store (nothing is decoded again: its data settings are eagle3_serve's), then on-policy, a final speculative eval
    and the vLLM / SGLang exports of the final head, all in one output directory."""
    from specdistill.pipeline.run import run

    cache = tmp_path / "cache"
    build_components(compose("eagle3_serve", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "serve",
                                                            cache)))  # its regeneration stage only
    (store,) = list((cache / "regenerated").iterdir())
    stamps = {p.name: p.stat().st_mtime_ns for p in store.glob("part-*")}
    out = tmp_path / "opd"
    res = run(compose("draft_opd", tiny_overrides(tiny_target_dir, tiny_data_file, out, cache) + [
        "warmup.steps=2", "warmup.epochs=null", "trainer.max_steps=2", "objective.max_new_tokens=6",
        "objective.gamma=2", "eval.spec_eval=true", "eval.num_prompts=2", "eval.max_new_tokens=6",
        "eval.prompts=" + str(tiny_data_file), "eval.gamma=2"]))
    assert res.step == 4 and res.preempted is None
    assert list((cache / "regenerated").iterdir()) == [store]
    assert {p.name: p.stat().st_mtime_ns for p in store.glob("part-*")} == stamps  # reused, not decoded again
    assert json.loads((out / "data_report.json").read_text())["source"] == f"regenerated:{store}"
    final = json.loads((out / "eval" / "final" / "results.json").read_text())
    assert final["greedy_mismatches"] == 0
    for fmt in ("vllm", "sglang"):
        assert json.loads((out / "export" / fmt / "config.json").read_text())["architectures"] == [
            "LlamaForCausalLMEagle3"]
    assert [p.name for p in list_checkpoints(out)] == ["step-0000002", "step-0000004"]  # the hand-over, the end


@pytest.mark.parametrize("schedule_steps", [None, 60])
def test_an_epoch_bounded_run_anneals_over_its_own_length(schedule_steps):
    """trainer.epochs ends the run long before trainer.max_steps (recipe=eagle3_serve: 100000): the cosine spans the
    run, so its last step trains near lr * min_lr_ratio (a horizon of max_steps would leave the lr nearly constant);
    trainer.schedule_steps sets another horizon."""
    from specdistill.config import TrainerConfig, WarmupConfig
    from specdistill.phases import plan_phases

    trainer = TrainerConfig(lr=1e-3, warmup_steps=2, min_lr_ratio=0.1, max_steps=100000, epochs=3, micro_batch_size=4,
                            grad_accum=1, seed=0, schedule_steps=schedule_steps)
    plan = plan_phases(trainer, WarmupConfig(), _Named("eagle3"), [{"input_ids": [1], "loss_mask": [0]}] * 40, 0)
    (main,) = plan.phases
    assert main.steps == 30 and main.horizon == (schedule_steps or 30)
    lrs = [main.lr_at(s) for s in range(main.steps)]
    assert lrs[2] == pytest.approx(1e-3) and all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    if schedule_steps is None:
        assert lrs[-1] == pytest.approx(1e-4, rel=0.05)  # step 29 of a 30-step horizon: just above the floor
    else:
        assert lrs[-1] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 27 / 58))))
