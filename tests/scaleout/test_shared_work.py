"""The processes of one launch share the work rather than leave it to rank 0 while the others wait: regeneration
(parts split among the processes that see the store folder, per node when it is node-local), the final speculative
evaluation (prompt batches split, counts merged into one process's result), with the process-group timeout from
trainer.process_group_timeout_s; and a target sharded over the processes (target.shard=fsdp) gives the same outputs.
One `torchrun --nproc_per_node 2` launch over gloo runs every check (tests/scaleout/shared_work_worker.py)."""
import pytest

from tests.scaleout.conftest import BIN, run_cmd, subprocess_env

pytestmark = pytest.mark.slow  # a real multi-process launch (deselect with -m "not slow")


def test_two_processes_share_regeneration_and_evaluation_and_shard_the_target(tiny_target_dir, tiny_data_file,
                                                                               tmp_path):
    proc = run_cmd([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2",
                    "tests/scaleout/shared_work_worker.py", str(tiny_target_dir), str(tiny_data_file), str(tmp_path)],
                   env=subprocess_env(SPECDISTILL_CACHE=str(tmp_path / "specdistill_cache")))
    log = proc.stdout + proc.stderr
    for rank in (0, 1):
        for check in ("regeneration shared", "build shared the regeneration", "evaluation shared",
                      "sharded target holds", "all checks passed"):
            assert f"[worker] rank {rank}: {check}" in log
