"""Preemption: SIGTERM at a random step of a real train.py process writes a resumable checkpoint and exits cleanly; a
kill -9 in the middle of a save leaves the previous checkpoint as the newest complete one. In both cases
trainer.resume=auto finishes with the weights of an uninterrupted run."""
import json
import random
import signal
import subprocess
import sys
import time

import pytest

from specdistill.build import build
from specdistill.train.checkpoint import list_checkpoints
from specdistill.train.loop import fit
from tests.conftest import compose, tiny_overrides
from tests.scaleout.conftest import REPO, assert_weights_close, draft_weights, subprocess_env

pytestmark = pytest.mark.slow  # real train.py processes, signalled and killed (deselect with -m "not slow")

MAX_STEPS = 10
STOP_SEED = 20261201  # the step the SIGTERM lands on is drawn from this seed: a failure reproduces
COMMON = [f"trainer.max_steps={MAX_STEPS}", "trainer.save_every=2", "trainer.keep_checkpoints=20", "trainer.lr=5e-3",
          "trainer.log_every=1", "trainer.warmup_steps=2"]


def _overrides(target, data, out, tmp):
    return tiny_overrides(target, data, out, tmp / "cache") + COMMON


@pytest.fixture(scope="module")
def uninterrupted(tiny_target_dir, tiny_data_file, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    res = fit(build(compose("kd", _overrides(tiny_target_dir, tiny_data_file, tmp / "out", tmp))))
    return draft_weights(res.final_checkpoint)


def _resume_and_compare(target, data, out, tmp, reference):
    res = fit(build(compose("kd", _overrides(target, data, out, tmp) + ["trainer.resume=auto"])))
    assert res.step == MAX_STEPS and res.preempted is None
    assert_weights_close(draft_weights(res.final_checkpoint), reference, atol=1e-6, rtol=1e-5)


def _logged_steps(out) -> int:
    f = out / "metrics.jsonl"
    return sum('"train/loss"' in line for line in f.read_text().splitlines()) if f.exists() else 0


def test_sigterm_at_a_random_step_saves_and_resume_equals_uninterrupted(tiny_target_dir, tiny_data_file, tmp_path,
                                                                        uninterrupted):
    out = tmp_path / "run"
    stop_after = random.Random(STOP_SEED).randint(1, 5)
    proc = subprocess.Popen([sys.executable, "train.py", "recipe=kd", *_overrides(tiny_target_dir, tiny_data_file, out,
                                                                                   tmp_path)],
                            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while _logged_steps(out) < stop_after and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, log[-3000:]  # a clean exit, not a traceback
    summary = json.loads((out / "summary.json").read_text())
    stopped = summary["step"]
    assert summary["preempted"] == "SIGTERM" and stop_after <= stopped < MAX_STEPS, (stop_after, log[-2000:])
    assert f"SIGTERM: stopped at step {stopped}" in log
    assert list_checkpoints(out)[-1].name == f"step-{stopped:07d}"  # the stop itself was checkpointed
    _resume_and_compare(tiny_target_dir, tiny_data_file, out, tmp_path, uninterrupted)


KILL_MID_SAVE = """
import os, runpy, signal, sys
real_replace = os.replace
def replace(src, dst):  # the checkpoint of step 4 is fully written under its temp name: die before the rename
    if str(src).endswith(".step-0000004.tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)
os.replace = replace
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_newest(tiny_target_dir, tiny_data_file, tmp_path,
                                                                    uninterrupted):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", KILL_MID_SAVE, "recipe=kd",
                           *_overrides(tiny_target_dir, tiny_data_file, out, tmp_path)],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ckpts = out / "checkpoints"
    assert (ckpts / ".step-0000004.tmp" / "trainer_state.json").exists()  # complete content, never renamed
    assert [p.name for p in list_checkpoints(out)] == ["step-0000002"]
    _resume_and_compare(tiny_target_dir, tiny_data_file, out, tmp_path, uninterrupted)
    assert not (ckpts / ".step-0000004.tmp").exists()  # debris removed by the next save
