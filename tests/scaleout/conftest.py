"""Helpers for the scale-out tests: run train.py (or a worker script) in real subprocesses, with one thread each."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def subprocess_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                                                                      "MASTER_", "PYTEST_"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_cmd(cmd: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env or subprocess_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def draft_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "draft" / "model.safetensors")


def assert_weights_close(a: dict, b: dict, atol: float, rtol: float = 1e-4) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=rtol), (k, (a[k] - b[k]).abs().max().item())
