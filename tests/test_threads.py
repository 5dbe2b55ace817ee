"""Torch threads are set deliberately (physical cores / local processes), overridable, printed, and a busy
machine is named."""
import os

import pytest
import torch

from specdistill import threads as th

HYPERTHREADED = "".join(f"processor\t: {i}\nphysical id\t: 0\ncore id\t\t: {i % 2}\n\n" for i in range(4))


@pytest.fixture(autouse=True)
def keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(th, "usable_cpus", lambda: 4)
    monkeypatch.setattr(th, "physical_cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))


def test_physical_cores_counts_cores_not_hyperthreads(tmp_path, monkeypatch):
    f = tmp_path / "cpuinfo"
    f.write_text(HYPERTHREADED)
    monkeypatch.setattr(th, "usable_cpus", lambda: 4)
    assert th.physical_cores(str(f)) == 2
    monkeypatch.setattr(th, "usable_cpus", lambda: 1)  # taskset / cgroup limits cap it
    assert th.physical_cores(str(f)) == 1


def test_default_is_physical_cores_over_local_processes(clean_env, monkeypatch):
    s = th.choose_threads()
    assert (s.threads, s.source) == (2, "physical cores / local processes")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert th.choose_threads().threads == 1


def test_override_and_omp_num_threads_win(clean_env, monkeypatch):
    assert th.choose_threads(3).source == "override" and th.choose_threads(3).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert (th.choose_threads().threads, th.choose_threads().source) == (1, "OMP_NUM_THREADS")
    assert th.choose_threads(2).threads == 2


def test_configure_sets_torch_prints_and_warns_when_busy(clean_env, monkeypatch):
    lines = []
    s = th.configure_threads(None, "eval.threads", log=lines.append)
    assert torch.get_num_threads() == s.threads == 2
    assert lines[0].startswith("[threads] torch uses 2 CPU thread(s) per process") and "eval.threads=N" in lines[0]
    assert len(lines) == 1  # idle machine: no warning
    monkeypatch.setattr(os, "getloadavg", lambda: (5.4, 4.0, 2.3))
    lines.clear()
    th.configure_threads(None, "eval.threads", log=lines.append)
    print("\n".join(lines))
    assert "machine is busy (load average 5.40" in lines[1] and "eval.threads=1" in lines[1]
