"""A real 2-process DDP run of train.py (gloo on CPU): one job (num_processes == WORLD_SIZE, identical parameters on
both ranks), and the same losses and weights as one process with the same global batch."""
import json

import pytest

from tests.conftest import ONPOLICY_ALONE, tiny_overrides
from tests.scaleout.conftest import BIN, STEPS, assert_matches_reference, run_cmd, subprocess_env

pytestmark = pytest.mark.slow  # real multi-process launches (deselect with -m "not slow")


def test_ddp_two_processes_equal_one_process_with_the_same_global_batch(tiny_target_dir, tiny_data_file, tmp_path,
                                                                        one_process_reference):
    out = tmp_path / "ddp2"
    over = tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + STEPS
    # The launch that really distributes on CPU: --multi_gpu (the config file) with ACCELERATE_USE_CPU.
    proc = run_cmd([str(BIN / "accelerate"), "launch", "--config_file", "conf/accelerate/ddp.yaml",
                    "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                    "train.py", "recipe=kd", *over], env=subprocess_env(ACCELERATE_USE_CPU="1"))
    log = proc.stdout + proc.stderr
    assert "[train] 2 process(es), DistributedType.MULTI_CPU" in log  # WORLD_SIZE=2, and accelerate sees 2 ranks
    assert "identical on all 2 ranks" in log  # replica check over gathered per-parameter fingerprints
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["step"] == 3
    assert_matches_reference(out, one_process_reference)


def test_draft_opd_under_ddp_rolls_out_per_rank_and_keeps_replicas_identical(tiny_target_dir, tiny_data_file,
                                                                             tmp_path):
    """Each rank rolls out its own prompts (a data-dependent number of draft and target forwards, on the unwrapped
    draft: no collectives), then one DDP forward per micro-batch syncs gradients: no hang, identical replicas, and
    each rank's replay buffer is checkpointed as its own objective state."""
    out = tmp_path / "opd2"
    over = tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + ONPOLICY_ALONE + [
        "trainer.max_steps=2", "trainer.save_every=2", "objective.max_new_tokens=6", "objective.gamma=3"]
    proc = run_cmd([str(BIN / "accelerate"), "launch", "--config_file", "conf/accelerate/ddp.yaml",
                    "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                    "train.py", "recipe=draft_opd", *over], env=subprocess_env(ACCELERATE_USE_CPU="1"))
    log = proc.stdout + proc.stderr
    assert "[train] 2 process(es), DistributedType.MULTI_CPU" in log
    assert "identical on all 2 ranks" in log
    assert json.loads((out / "summary.json").read_text())["step"] == 2
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("train/rollout_tau" in r and "train/replay_size" in r for r in rows)
    state = out / "checkpoints" / "step-0000002" / "state"
    assert (state / "objective_0.pt").exists() and (state / "objective_1.pt").exists()
