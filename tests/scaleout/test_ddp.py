"""A real 2-process DDP run of train.py (gloo on CPU): one job (num_processes == WORLD_SIZE, identical parameters on
both ranks), and the same losses and weights as one process with the same global batch."""
import json

from tests.conftest import tiny_overrides
from tests.scaleout.conftest import BIN, STEPS, assert_matches_reference, run_cmd, subprocess_env


def test_ddp_two_processes_equal_one_process_with_the_same_global_batch(tiny_target_dir, tiny_data_file, tmp_path,
                                                                        one_process_reference):
    out = tmp_path / "ddp2"
    over = tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + STEPS
    # The launch that really distributes on CPU (shared/notes/cpu-stack.md): --multi_gpu with ACCELERATE_USE_CPU.
    proc = run_cmd([str(BIN / "accelerate"), "launch", "--config_file", "conf/accelerate/ddp.yaml",
                    "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                    "train.py", "recipe=kd", *over], env=subprocess_env(ACCELERATE_USE_CPU="1"))
    log = proc.stdout + proc.stderr
    assert "[train] 2 process(es), DistributedType.MULTI_CPU" in log  # WORLD_SIZE=2, and accelerate sees 2 ranks
    assert "identical on all 2 ranks" in log  # replica check over gathered per-parameter fingerprints
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["step"] == 3
    assert_matches_reference(out, one_process_reference)
