"""`train.py recipe=draft_opd draft=dflash` through the real entry point (Hydra's command line, then every stage):
warm-up, hand-over, on-policy steps, final speculative evaluation and the vLLM export. A run stopped right after the
hand-over's checkpoint and started again with trainer.resume=auto ends as the uninterrupted run: same weights, same
final evaluation, every stage recorded, no step logged twice."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from specdistill.pipeline.run import read_stages
from specdistill.train.checkpoint import list_checkpoints
from tests.conftest import tiny_overrides
from tests.dflash.test_dflash_opd import RUN  # 3 warm-up steps (block size 4), the hand-over, 3 on-policy steps

REPO = Path(__file__).resolve().parents[2]
STAGES = ["eval.spec_eval=true", "eval.spec_eval_at=end", "eval.num_prompts=2", "eval.max_new_tokens=6",
          "eval.gamma=3", "eval.warmup_prompts=0", "eval.measure_cost=false", "trainer.threads=1"]
HAND_OVER = 3  # the warm-up's last step: its checkpoint is the hand-over's


def _weights(checkpoint: Path) -> dict:
    return load_file(checkpoint / "draft" / "model.safetensors")


@pytest.fixture(scope="module")
def train(tiny_target_dir, tiny_data_file, tmp_path_factory):
    """train(out, *overrides): `python train.py recipe=draft_opd ...` into out, asserting it exits 0."""
    cache = tmp_path_factory.mktemp("dflash_opd_cli") / "cache"

    def run(out: Path, *extra: str) -> str:
        args = tiny_overrides(tiny_target_dir, tiny_data_file, out, cache) + RUN + STAGES + [
            f"eval.prompts={tiny_data_file}", *extra]
        p = subprocess.run([sys.executable, "train.py", "recipe=draft_opd", *args], cwd=REPO, capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
        return p.stdout

    return run


@pytest.fixture(scope="module")
def whole(train, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    train(out)
    return out


def test_the_command_line_runs_every_stage(whole):
    states = [json.loads((p / "trainer_state.json").read_text()) for p in list_checkpoints(whole)]
    assert [(s["step"], s["phase"]) for s in states] == [(2, "warmup"), (3, "warmup"), (4, "main"), (6, "main")]
    assert set(read_stages(whole)) == {"eval/final", "export/vllm"}  # sglang, speculators: EAGLE-3 layouts only
    assert json.loads((whole / "export" / "vllm" / "config.json").read_text())["block_size"] == 4
    results = json.loads((whole / "eval" / "final" / "results.json").read_text())
    assert 1.0 <= results["mean_accept_len"] <= 1 + 3 and results["greedy_mismatches"] == 0
    assert json.loads((whole / "summary.json").read_text())["step"] == 6


def test_a_run_stopped_after_the_hand_over_resumes_to_the_same_end(train, whole, tmp_path):
    stopped = tmp_path / "run"
    shutil.copytree(whole / "checkpoints", stopped / "checkpoints")
    for ck in list_checkpoints(stopped):  # stopped while taking the first on-policy step
        if int(ck.name.removeprefix("step-")) > HAND_OVER:
            shutil.rmtree(ck)
    for name in ("config.yaml", "data_report.json"):
        shutil.copy(whole / name, stopped / name)
    lines = (whole / "metrics.jsonl").read_text().splitlines()
    (stopped / "metrics.jsonl").write_text("".join(f"{x}\n" for x in lines if json.loads(x)["step"] <= HAND_OVER + 1))
    log = train(stopped, "trainer.resume=auto")
    assert f"step-{HAND_OVER:07d} at step {HAND_OVER}" in log  # "[train] resumed from ...": at the hand-over
    want, got = _weights(list_checkpoints(whole)[-1]), _weights(list_checkpoints(stopped)[-1])
    assert want.keys() == got.keys() and all(bool((want[k] == got[k]).all()) for k in want)
    assert set(read_stages(stopped)) == {"eval/final", "export/vllm"}
    final = [json.loads((d / "eval" / "final" / "results.json").read_text()) for d in (whole, stopped)]
    assert final[0]["mean_accept_len"] == final[1]["mean_accept_len"]
    steps = [m["step"] for m in map(json.loads, (stopped / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in m]
    assert steps == sorted(set(steps)) and steps[-1] == 6  # replayed steps logged once
