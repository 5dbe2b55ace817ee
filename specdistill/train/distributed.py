"""The accelerator for every launch mode (single process, DDP, DeepSpeed ZeRO-2/3; FSDP through accelerate on GPU),
with the checks that catch the silent failure of multi-process launches: ranks that each train alone.

Launch configs live in conf/accelerate/ (README "Scale-out"). On a machine without CUDA the process group uses gloo
(DeepSpeed would otherwise ask for oneCCL); `accelerate launch --cpu --num_processes 2` runs ONE process and some other
combinations start processes that never form a group, so `check_world` compares accelerate's view with WORLD_SIZE.
"""
from __future__ import annotations

import os

import torch
from omegaconf import DictConfig


def launched_world_size() -> int:
    """The number of processes the launcher started (torchrun / accelerate launch set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def make_launch_accelerator(cfg: DictConfig):
    """build.make_accelerator, after initialising the process group the way this machine needs, then configured for
    DeepSpeed (batch sizes and clipping from trainer.*) and checked against WORLD_SIZE."""
    from accelerate import PartialState

    from specdistill.build import make_accelerator

    if launched_world_size() > 1 and not torch.cuda.is_available():
        if not _env_true("ACCELERATE_USE_DEEPSPEED"):
            os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # accelerate's MULTI_CPU (DDP over gloo)
        PartialState(backend="gloo")  # the shared state every Accelerator created after this reuses
    acc = make_accelerator(cfg)
    check_world(acc)
    configure_deepspeed(acc, cfg)
    return acc


def check_world(acc) -> None:
    world = launched_world_size()
    if acc.num_processes != world:
        raise RuntimeError(f"the launcher started {world} processes but accelerate sees {acc.num_processes} "
                           f"(distributed_type={acc.distributed_type}): every rank would train alone. On CPU use "
                           "`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ...` or torchrun "
                           "(README, Scale-out)")


def configure_deepspeed(acc, cfg: DictConfig) -> None:
    """DeepSpeed needs the per-rank micro-batch before prepare(); the loop does its own accumulation (one engine step
    per optimizer step, gradient_accumulation_steps 1) and DeepSpeed does the clipping (trainer.max_grad_norm)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    t = cfg.trainer
    ds = plugin.deepspeed_config
    gas = ds.get("gradient_accumulation_steps", "auto")
    if gas not in ("auto", 1):
        raise ValueError(f"DeepSpeed gradient_accumulation_steps={gas}: leave it 1 or auto and set trainer.grad_accum "
                         "(the loop accumulates and normalises by the global token count itself)")
    ds.update(train_micro_batch_size_per_gpu=t.micro_batch_size, gradient_accumulation_steps=1,
              train_batch_size=t.micro_batch_size * acc.num_processes, gradient_clipping=float(t.max_grad_norm))


def is_deepspeed(acc) -> bool:
    return "DEEPSPEED" in str(getattr(acc, "distributed_type", ""))


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
