"""One writer per folder: a second run into a folder in use is refused naming the holder; a dead holder's lock is
taken over with a message; the lock goes when its holder ends."""
import json
import os
import socket
import subprocess
import sys

import pytest

from specdistill.files import LOCK_FILE, FolderBusy, folder_lock
from tests.conftest import compose, tiny_overrides


@pytest.fixture
def other_process():
    """A live process that is not this one (the holder of a lock)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


def _hold(folder, pid, host=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                                "started": "2026-12-02T03:00:00", "command": "train.py recipe=kd"}))


def test_a_live_holder_refuses_a_second_writer_by_name(tmp_path, other_process):
    _hold(tmp_path, other_process)
    with pytest.raises(FolderBusy, match=rf"pid {other_process} on .*train.py recipe=kd.*trainer.output_dir"):
        with folder_lock(tmp_path, "trainer.output_dir"):
            pass
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == other_process  # left to its holder


def test_a_holder_on_another_host_is_never_taken_over(tmp_path):
    _hold(tmp_path, 999999, host="some-other-node")
    with pytest.raises(FolderBusy, match="some-other-node"):
        with folder_lock(tmp_path, "eval.output_dir"):
            pass


def test_a_dead_holders_lock_is_taken_over_with_a_message_and_released_at_the_end(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _hold(tmp_path, dead.pid)
    said = []
    with folder_lock(tmp_path, "trainer.output_dir", log=said.append):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        with folder_lock(tmp_path, "trainer.output_dir"):  # the same process may nest it
            pass
        assert (tmp_path / LOCK_FILE).exists()  # the inner one left it to the outer
    assert len(said) == 1 and f"pid {dead.pid}" in said[0] and "no longer running" in said[0]
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_lock_is_released_when_the_writer_fails(tmp_path):
    with pytest.raises(RuntimeError, match="the writer failed"):
        with folder_lock(tmp_path, "trainer.output_dir"):
            raise RuntimeError("the writer failed")
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_second_training_run_into_a_busy_output_dir_is_refused_before_any_work(tiny_target_dir, tiny_data_file,
                                                                                  tmp_path, other_process,
                                                                                  monkeypatch):
    """Two runs on one trainer.output_dir at once: the second is refused naming the first, and writes nothing."""
    import specdistill.pipeline.run as pipeline

    out = tmp_path / "out"
    _hold(out, other_process)

    def no_build(*a, **k):
        raise AssertionError("built although the folder is in use")

    monkeypatch.setattr(pipeline, "assemble", no_build)
    with pytest.raises(FolderBusy, match=f"pid {other_process}"):
        pipeline.run(compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache")))
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]


def test_an_evaluation_into_a_busy_output_dir_is_refused(tiny_target_dir, tiny_data_file, tmp_path, other_process):
    from specdistill.eval.run import run as evaluate

    out = tmp_path / "eval"
    _hold(out, other_process)
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "o", tmp_path / "cache")
                  + ["eval.drafter=ngram", f"eval.output_dir={out}", "eval.device=cpu"])
    with pytest.raises(FolderBusy, match="eval.output_dir"):
        evaluate(cfg, log=lambda *_: None)
