"""Helpers for the scale-out tests: run train.py (or a worker script) in real subprocesses, with one thread each."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
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


# Every multi-process run is compared with this one-process run of the same global batch: 1 x 4 x 2 (grad_accum x
# micro-batch) == 2 ranks x 2 x 2, and StepBatches gives step s the same examples in both layouts.
STEPS = ["trainer.max_steps=3", "trainer.lr=1e-2", "trainer.max_grad_norm=1.0", "trainer.warmup_steps=0"]


def losses(out_dir: Path) -> list[float]:
    import json

    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


@pytest.fixture(scope="session")
def one_process_reference(tiny_target_dir, tiny_data_file, tmp_path_factory) -> Path:
    from specdistill.build import build
    from specdistill.train.loop import fit
    from tests.conftest import compose, tiny_overrides

    root = tmp_path_factory.mktemp("reference")
    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, root / "out", root / "cache") + STEPS
                  + ["trainer.grad_accum=4"])
    fit(build(cfg))
    return root / "out"


def assert_matches_reference(out_dir: Path, reference: Path, atol: float = 2e-5) -> None:
    l1, l2 = losses(reference), losses(out_dir)
    assert len(l1) == len(l2) == 3
    for a, b in zip(l1, l2):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (l1, l2)
    final = "checkpoints/step-0000003"
    assert_weights_close(draft_weights(reference / final), draft_weights(out_dir / final), atol=atol)
