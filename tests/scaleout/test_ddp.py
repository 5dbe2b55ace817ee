"""A real 2-process DDP run of train.py (gloo on CPU): one job (num_processes == WORLD_SIZE, identical parameters on
both ranks), and the same losses and weights as one process with the same global batch."""
import json

from specdistill.build import build
from specdistill.train.loop import fit
from tests.conftest import compose, tiny_overrides
from tests.scaleout.conftest import BIN, assert_weights_close, draft_weights, run_cmd, subprocess_env

STEPS = ["trainer.max_steps=3", "trainer.lr=1e-2", "trainer.max_grad_norm=1.0", "trainer.warmup_steps=0"]


def _losses(out_dir):
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def test_ddp_two_processes_equal_one_process_with_the_same_global_batch(tiny_target_dir, tiny_data_file, tmp_path):
    out2 = tmp_path / "ddp2"
    over = tiny_overrides(tiny_target_dir, tiny_data_file, out2, tmp_path / "cache") + STEPS
    # The launch that really distributes on CPU (shared/notes/cpu-stack.md): --multi_gpu with ACCELERATE_USE_CPU.
    proc = run_cmd([str(BIN / "accelerate"), "launch", "--config_file", "conf/accelerate/ddp.yaml",
                    "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                    "train.py", "recipe=kd", *over], env=subprocess_env(ACCELERATE_USE_CPU="1"))
    log = proc.stdout + proc.stderr
    assert "[train] 2 process(es), DistributedType.MULTI_CPU" in log  # WORLD_SIZE=2 and accelerate sees 2
    assert "identical on all 2 ranks" in log  # replica check over gathered per-parameter fingerprints
    summary = json.loads((out2 / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["step"] == 3

    # One process, same global batch (1 x 4 x 2 == 2 ranks x 2 x 2), same examples in each step.
    out1 = tmp_path / "single"
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, out1, tmp_path / "cache") + STEPS
                  + ["trainer.grad_accum=4"])
    res = fit(build(cfg))
    l1, l2 = _losses(out1), _losses(out2)
    assert len(l1) == len(l2) == 3
    for a, b in zip(l1, l2):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (l1, l2)
    assert_weights_close(draft_weights(res.final_checkpoint), draft_weights(out2 / "checkpoints" / "step-0000003"),
                         atol=2e-5)
