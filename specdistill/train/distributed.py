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
        # The shared state every Accelerator created after this reuses: DDP over gloo (accelerate's MULTI_CPU), or
        # DeepSpeed over gloo. Without cpu=True accelerate would see 2 ranks and run them as DistributedType.NO.
        PartialState(cpu=not _env_true("ACCELERATE_USE_DEEPSPEED"), backend="gloo")
    acc = make_accelerator(cfg)
    check_world(acc)
    configure_deepspeed(acc, cfg)
    acc.print(f"[train] {acc.num_processes} process(es), {acc.distributed_type}, device {acc.device}")
    return acc


def check_world(acc) -> None:
    world = launched_world_size()
    if acc.num_processes != world or (world > 1 and str(acc.distributed_type).endswith(".NO")):
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


def is_sharded(acc) -> bool:
    """Parameters split across ranks (FSDP, DeepSpeed ZeRO-3): no rank holds the whole draft."""
    kind = str(getattr(acc, "distributed_type", ""))
    if "FSDP" in kind:
        return True
    plugin = getattr(acc.state, "deepspeed_plugin", None) if "DEEPSPEED" in kind else None
    return plugin is not None and plugin.zero_stage == 3


@torch.no_grad()
def replica_fingerprints(model) -> torch.Tensor:
    """(n_params, 2) float64: sum and sum of squares of each parameter tensor, to compare replicas across ranks."""
    rows = [torch.stack([p.sum(dtype=torch.float64), p.double().square().sum()]) for p in model.parameters()]
    return torch.stack(rows).cpu()


def check_replicas(acc, model) -> bool:
    """True when every rank holds bit-identical draft parameters (DDP, ZeRO-1/2). Returns True without checking where
    the parameters are sharded, raises RuntimeError when replicas differ (ranks trained apart)."""
    if acc.num_processes == 1 or is_sharded(acc):
        return True
    from accelerate.utils import gather_object

    mine = replica_fingerprints(acc.unwrap_model(model))
    every = gather_object([mine])
    bad = [r for r, f in enumerate(every) if not torch.equal(f, every[0])]
    if bad:
        raise RuntimeError(f"draft parameters differ between rank 0 and ranks {bad}: the ranks did not train as one "
                           "data-parallel job")
    acc.print(f"[train] the draft's parameters are identical on all {acc.num_processes} ranks")
    return True


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
