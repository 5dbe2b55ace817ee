"""Atomic checkpoints that resume exactly: a step folder is written under a temp name and renamed when complete.

Layout of <output_dir>/checkpoints/step-0000100/:
  draft/              the draft in HF format (safetensors, config.json, tokenizer)
  state/              accelerate.save_state: model, optimizer, scheduler, RNG of every rank; objective_<rank>.pt:
                      the objective's own state on every rank when it has one (Draft-OPD: replay buffer, cached
                      rollout, rollout RNG), so an on-policy run resumes exactly
  trainer_state.json  step, epoch, tokens seen
  metrics.json        the latest metrics (training and held-out acceptance)
  config.yaml         the fully resolved config of the run
  manifest.json       size and SHA-256 of every file above (resume verifies them; a corrupt step-N is renamed
                      step-N.corrupt and the previous one is used)
A folder whose name starts with "." is incomplete (a crash mid-save: .step-N.tmp) or being deleted (.step-N.del) and is
never resumed from; debris of either kind is removed by the next save.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from specdistill.files import follow_umask
from specdistill.train.integrity import write_manifest

STEP_RE = re.compile(r"^step-(\d+)$")


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(output_dir)
    if not root.exists():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name))
             and (p / "trainer_state.json").exists()]
    return [p for _, p in sorted(found)]


def resolve_resume(resume: Optional[str], output_dir: str | Path) -> Optional[Path]:
    if not resume:
        return None
    if resume == "auto":
        ckpts = list_checkpoints(output_dir)
        return ckpts[-1] if ckpts else None
    p = Path(resume).expanduser()
    if not (p / "trainer_state.json").exists() or not (p / "state").exists():
        raise FileNotFoundError(f"trainer.resume={resume!r} is not a complete checkpoint folder (needs "
                                "trainer_state.json and state/); use trainer.resume=auto to take the newest one")
    return p


def save_checkpoint(accelerator, draft, tokenizer, output_dir, step: int, trainer_state: dict, metrics: dict,
                    config_yaml: str, keep: int = 2, objective=None) -> Path:
    """Every rank must call this (accelerate gathers state); only the main process writes shared files.
    `objective`: saved per rank when it has a state_dict() (not accelerate's register_for_checkpointing, which
    keeps rank 0's copy only; on-policy state such as a replay buffer differs per rank)."""
    root = checkpoint_dir(output_dir)
    final = root / f"step-{step:07d}"
    tmp = root / f".step-{step:07d}.tmp"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for debris in [*root.glob(".step-*.tmp"), *root.glob(".step-*.del")]:
            shutil.rmtree(debris, ignore_errors=True)  # left by a process killed mid-save or mid-delete
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "state"))
    if callable(getattr(objective, "state_dict", None)):
        import torch

        (tmp / "state").mkdir(parents=True, exist_ok=True)
        torch.save(objective.state_dict(), tmp / "state" / f"objective_{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()  # every rank's files are in place before the main process renames
    state_dict = accelerator.get_state_dict(draft)  # full state dict (gathered under FSDP/ZeRO-3)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(draft)
        unwrapped.save_pretrained(tmp / "draft", state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "draft")
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=1))
        (tmp / "config.yaml").write_text(config_yaml)
        # trainer_state.json is written last: its presence marks the content complete, the rename makes it visible.
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        write_manifest(tmp)  # sizes + SHA-256 of every file: resume verifies them (train/integrity.py)
        follow_umask(tmp)
        _fsync_dir(tmp)
        if final.exists():  # a re-save of this step: move the old copy aside first (a kill here keeps it whole)
            _discard(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
            _discard(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path, objective=None) -> dict:
    """Restore model, optimizer, scheduler and RNG (and the objective's own state) in place; return the trainer
    state (step, epoch...)."""
    accelerator.load_state(str(path / "state"))
    if callable(getattr(objective, "load_state_dict", None)):
        import torch

        f = path / "state" / f"objective_{accelerator.process_index}.pt"
        if f.exists():
            objective.load_state_dict(torch.load(f, map_location="cpu", weights_only=False))
        else:
            print(f"[train] warning: {f} is missing (a checkpoint from another objective or number of processes): "
                  f"the objective {type(objective).__name__} starts with fresh state, so this resume is not exact")
    return json.loads((path / "trainer_state.json").read_text())


def _discard(path: Path) -> None:
    """Delete a checkpoint so that no kill -9 leaves a half-deleted folder under a step-N name: rename to a dot-name
    (never listed, never resumed from) first, then delete."""
    trash = path.with_name(f".{path.name}.del")
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
