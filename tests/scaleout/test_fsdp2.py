"""FSDP2 (torch fully_shard) under torchrun over gloo, 2 processes of train.py: parameters really sharded, the full HF
draft written once by rank 0, the same losses and weights as one process with the same global batch, and an exact
resume from the sharded (torch.distributed.checkpoint) state."""
import json

import pytest

from tests.conftest import tiny_overrides
from tests.scaleout.conftest import BIN, STEPS, assert_matches_reference, run_cmd, subprocess_env

pytestmark = pytest.mark.slow  # real multi-process launches (deselect with -m "not slow")


def _torchrun(over, tmp_path):
    return run_cmd([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "train.py", "recipe=kd", *over],
                   env=subprocess_env(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2"))


def test_fsdp2_two_processes_equal_one_process(tiny_target_dir, tiny_data_file, tmp_path, one_process_reference):
    out = tmp_path / "fsdp2"
    over = tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + STEPS
    proc = _torchrun(over + ["trainer.save_every=2", "trainer.keep_checkpoints=5"], tmp_path)
    log = proc.stdout + proc.stderr
    assert "[train] 2 process(es), FSDP2 (fully_shard over gloo)" in log
    local, total = map(int, log.split("FSDP2: rank 0 holds ")[1].split(" parameters")[0].split(" of the draft's "))
    assert local < 0.6 * total  # really sharded (dim-0 shards of every tensor: about half each)
    assert json.loads((out / "summary.json").read_text())["num_processes"] == 2
    # each rank wrote its shard of model and optimizer; rank 0 wrote the gathered HF draft
    shards = sorted(p.name for p in (out / "checkpoints" / "step-0000002" / "state" / "fsdp2").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert_matches_reference(out, one_process_reference)

    # resume from step 2 in a fresh folder holding only that checkpoint: the same final weights
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step-0000002").rename(resumed / "checkpoints" / "step-0000002")
    over = tiny_overrides(tiny_target_dir, tiny_data_file, resumed, tmp_path / "cache") + STEPS
    log = (lambda p: p.stdout + p.stderr)(_torchrun(over + ["trainer.resume=auto"], tmp_path))
    assert "resumed from" in log and "at step 2" in log
    assert_matches_reference_final(resumed, out)


def assert_matches_reference_final(a, b):
    from tests.scaleout.conftest import assert_weights_close, draft_weights

    final = "checkpoints/step-0000003"
    assert_weights_close(draft_weights(a / final), draft_weights(b / final), atol=1e-6, rtol=1e-5)
