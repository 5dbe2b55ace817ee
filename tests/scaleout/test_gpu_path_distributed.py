"""The EAGLE-3 head on the multi-GPU paths, run for real on CPU over gloo with 2 processes: Draft-OPD (warm-up, then
the on-policy phase) under DDP, and ZeRO-2 bf16 beside an fp32 and a bf16 target (a bf16 head reading the target's
features). Every launch is one job (num_processes == WORLD_SIZE) whose replicas end identical."""
import json
import math

import pytest

from specdistill.pipeline.run import build_components
from specdistill.train.loop import fit
from tests.conftest import compose, tiny_overrides
from tests.scaleout.conftest import BIN, losses, run_cmd, subprocess_env

pytestmark = pytest.mark.slow  # real multi-process launches (deselect with -m "not slow")

try:
    import deepspeed  # noqa: F401
except ImportError:  # scripts/setup.sh installs the `deepspeed` extra; a bare `pip install -e .` does not
    deepspeed = None

# 2 warm-up steps (objective eagle3), then 2 on-policy steps (draft_opd) with the head: the hand-over included.
HAND_OVER = ["data.regenerate.enabled=false", "warmup.steps=2", "warmup.epochs=null", "warmup.micro_batch_size=2",
             "warmup.warmup_steps=1", "warmup.schedule_steps=null", "trainer.max_steps=2",
             "objective.max_new_tokens=6", "objective.gamma=2", "objective.replay_ratio=0.5",
             "trainer.export_formats=[]", "trainer.measure_roofline=false"]


def _one_job(log: str, kind: str) -> None:
    assert f"[train] 2 process(es), DistributedType.{kind}" in log  # WORLD_SIZE=2, and accelerate sees 2 ranks
    assert "identical on all 2 ranks" in log  # gradients were synced: the replicas never drifted apart


def test_draft_opd_with_an_eagle3_head_under_ddp_hands_over_and_syncs(tiny_target_dir, tiny_data_file, tmp_path):
    """Each rank rolls out its own prompts with the unwrapped head; the loss forward (the sparse TTT unroll along each
    round's chains) runs through DDP's forward, so the reducer averages its gradients across ranks."""
    out = tmp_path / "opd_eagle3"
    over = tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + HAND_OVER
    proc = run_cmd([str(BIN / "accelerate"), "launch", "--config_file", "conf/accelerate/ddp.yaml",
                    "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                    "train.py", "recipe=draft_opd", *over], env=subprocess_env(ACCELERATE_USE_CPU="1"))
    _one_job(proc.stdout + proc.stderr, "MULTI_CPU")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["step"] == 4
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    main = [r for r in rows if r.get("phase") == "main" and "train/loss" in r]
    assert [r.get("phase") for r in rows if "train/loss" in r][:2] == ["warmup", "warmup"] and len(main) == 2
    assert all("train/rollout_tau" in r and math.isfinite(r["train/loss"]) for r in main)


@pytest.mark.skipif(deepspeed is None, reason="deepspeed is not installed: run scripts/setup.sh (installs the "
                                              "`deepspeed` extra) or pip install -e '.[deepspeed]'")
@pytest.mark.parametrize("target_dtype", ["float32", "bfloat16"])
def test_deepspeed_zero2_bf16_trains_an_eagle3_head_near_the_fp32_run(target_dtype, tiny_target_dir, tiny_data_file,
                                                                      tmp_path):
    """DeepSpeed bf16 casts the head to bf16 and runs no autocast: the head takes an fp32 target's features by casting
    them at its input. Its losses stay within a few percent of one fp32 process with the same global batch."""
    steps = ["trainer.max_steps=2", "trainer.lr=1e-3", "trainer.warmup_steps=0", "data.regenerate.enabled=false",
             "trainer.export_formats=[]", "trainer.measure_roofline=false", "draft.draft_vocab_size=96"]
    out = tmp_path / "zero2"
    over = tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + steps + [
        f"target.dtype={target_dtype}", "trainer.mixed_precision=bf16"]
    proc = run_cmd([str(BIN / "accelerate"), "launch", "--config_file", "conf/accelerate/deepspeed_zero2.yaml",
                    "--num_processes", "2", "train.py", "recipe=eagle3", *over], env=subprocess_env(), timeout=400)
    _one_job(proc.stdout + proc.stderr, "DEEPSPEED")
    ref = tmp_path / "fp32"
    fit(build_components(compose("eagle3", tiny_overrides(tiny_target_dir, tiny_data_file, ref, tmp_path / "cache")
                                 + steps + ["trainer.grad_accum=4", "trainer.mixed_precision=no"])))
    got, want = losses(out), losses(ref)
    assert len(got) == len(want) == 2 and all(math.isfinite(x) for x in got)
    assert got != want  # the head really ran in bf16
    for a, b in zip(got, want):
        assert abs(a - b) <= 0.05 * abs(b), (got, want)
