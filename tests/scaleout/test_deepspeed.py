"""DeepSpeed ZeRO-2 through accelerate launch and conf/accelerate/deepspeed_zero2.yaml, 2 processes over
gloo: a real DeepSpeed engine (optimizer state and gradients partitioned), equal to one process with the same global
batch."""
import json

import pytest

from tests.conftest import tiny_overrides
from tests.scaleout.conftest import BIN, STEPS, assert_matches_reference, run_cmd, subprocess_env

pytestmark = pytest.mark.slow  # real multi-process launches (deselect with -m "not slow")

try:
    import deepspeed  # noqa: F401
except ImportError:  # scripts/setup.sh installs the `deepspeed` extra; a bare `pip install -e .` does not
    deepspeed = None


@pytest.mark.skipif(deepspeed is None, reason="deepspeed is not installed: run scripts/setup.sh (installs the "
                                              "`deepspeed` extra) or pip install -e '.[deepspeed]'")
def test_deepspeed_zero2_two_processes_equal_one_process(tiny_target_dir, tiny_data_file, tmp_path,
                                                         one_process_reference):
    out = tmp_path / "zero2"
    over = tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + STEPS
    proc = run_cmd([str(BIN / "accelerate"), "launch", "--config_file",
                    "conf/accelerate/deepspeed_zero2.yaml", "--num_processes", "2", "train.py", "recipe=kd",
                    *over], env=subprocess_env(), timeout=400)
    log = proc.stdout + proc.stderr
    assert "[train] 2 process(es), DistributedType.DEEPSPEED" in log
    assert "identical on all 2 ranks" in log  # ZeRO-2 keeps whole parameters on every rank
    assert json.loads((out / "summary.json").read_text())["num_processes"] == 2
    # DeepSpeed clips with the global norm itself (trainer.max_grad_norm) and steps once per optimizer step.
    assert_matches_reference(out, one_process_reference, atol=5e-5)
