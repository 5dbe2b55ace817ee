"""The accelerator for every launch mode (single process, DDP, DeepSpeed ZeRO-2/3; FSDP through accelerate on GPU),
with the checks that catch the silent failure of multi-process launches: ranks that each train alone.

Launch configs live in conf/accelerate/ (docs/guide.md "Scale-out"). On a machine without CUDA the process group
uses gloo (DeepSpeed would otherwise ask for oneCCL); `accelerate launch --cpu --num_processes 2` runs ONE process and
some other combinations start processes that never form a group, so `check_world` compares accelerate's view with
WORLD_SIZE.
"""
from __future__ import annotations

import contextlib
import os

import torch
from accelerate import Accelerator

from specdistill.config import TrainerConfig


def launched_world_size() -> int:
    """The number of processes the launcher started (torchrun / accelerate launch set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def make_launch_accelerator(t: TrainerConfig) -> Accelerator:
    """build.make_accelerator, after initialising the process group the way this machine needs, then configured for
    DeepSpeed (batch sizes and clipping from trainer.*) and checked against WORLD_SIZE."""
    from accelerate import PartialState

    from specdistill.build import make_accelerator
    from specdistill.ranks import process_group_timeout

    cpu_fsdp2 = False
    if launched_world_size() > 1 and not torch.cuda.is_available():
        # accelerate's FSDP route needs CUDA: on CPU the draft is sharded with torch's fully_shard here instead.
        if _env_true("ACCELERATE_USE_FSDP"):
            if os.environ.get("FSDP_VERSION", "2") != "2":
                raise ValueError("on CPU only FSDP2 runs (FSDP_VERSION=2 / fsdp_version: 2)")
            cpu_fsdp2 = True
            for k in [k for k in os.environ if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"]:
                os.environ.pop(k)  # or accelerate would build its (CUDA-only) FSDP plugin
        # The shared state every Accelerator created after this reuses: DDP over gloo (accelerate's MULTI_CPU), or
        # DeepSpeed over gloo. Without cpu=True accelerate would see 2 ranks and run them as DistributedType.NO.
        PartialState(cpu=not _env_true("ACCELERATE_USE_DEEPSPEED"), backend="gloo",
                     timeout=process_group_timeout(t.process_group_timeout_s))
    acc = make_accelerator(t)
    if cpu_fsdp2:
        acc.__class__ = CpuFsdp2Accelerator  # keeps make_accelerator's settings; changes how the draft is prepared
    check_world(acc)
    configure_deepspeed(acc, t)
    kind = "FSDP2 (fully_shard over gloo)" if cpu_fsdp2 else acc.distributed_type
    acc.print(f"[train] {acc.num_processes} process(es), {kind}, device {acc.device}")
    return acc


def check_world(acc) -> None:
    world = launched_world_size()
    if acc.num_processes != world or (world > 1 and str(acc.distributed_type).endswith(".NO")):
        raise RuntimeError(f"the launcher started {world} processes but accelerate sees {acc.num_processes} "
                           f"(distributed_type={acc.distributed_type}): every rank would train alone. On CPU use "
                           "`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ...` or torchrun "
                           "(docs/guide.md, Scale-out)")


def configure_deepspeed(acc, t: TrainerConfig) -> None:
    """DeepSpeed needs the per-rank micro-batch before prepare(); the loop does its own accumulation (one engine step
    per optimizer step, gradient_accumulation_steps 1) and DeepSpeed does the clipping (trainer.max_grad_norm)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    if plugin.zero_stage == 3:
        # With zero3_init, transformers builds every model under deepspeed.zero.Init: the frozen target would be
        # partitioned too, and rank 0 loading it inside main_process_first (others at the barrier) deadlocks on
        # zero.Init's broadcasts. The draft is partitioned by deepspeed.initialize in prepare() instead.
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        plugin.zero3_init_flag = False
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
    if "FSDP" in kind or isinstance(acc, CpuFsdp2Accelerator):
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


class CpuFsdp2Accelerator(Accelerator):
    """FSDP2 on machines without CUDA, where accelerate's FSDP route does not run: the draft's decoder layers and then
    the whole draft are `fully_shard`-ed over the gloo group (parameters, gradients and optimizer state split across
    ranks, reduce-scatter averaging like DDP). Everything else is accelerate's MULTI_CPU. Checkpoints: state/ holds the
    sharded model and optimizer through torch.distributed.checkpoint (resumable on the same world size) plus
    accelerate's scheduler and RNG files; get_state_dict gathers the full state dict on rank 0 for the HF draft/.
    Selected by ACCELERATE_USE_FSDP=true (what `accelerate launch --config_file conf/accelerate/fsdp.yaml`
    sets, or by hand under torchrun) on a machine without CUDA."""

    def prepare(self, *objects):
        from torch.distributed.fsdp import fully_shard

        model = next(o for o in objects if isinstance(o, torch.nn.Module))
        optimizer = next((o for o in objects if isinstance(o, torch.optim.Optimizer)), None)
        before = list(model.parameters())
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for m in model.modules():
            if type(m).__name__ in blocks:
                fully_shard(m)
        fully_shard(model)
        if optimizer is not None:  # fully_shard replaced the parameters (DTensors): point the optimizer at them
            new = dict(zip(map(id, before), model.parameters()))
            for group in optimizer.param_groups:
                group["params"] = [new[id(p)] for p in group["params"]]
            self._optimizers.append(optimizer)
        self._models.append(model)
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        self.print(f"[train] FSDP2: rank 0 holds {local} of the draft's {total} parameters")
        return tuple(objects)

    @contextlib.contextmanager
    def no_sync(self, model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def get_state_dict(self, model, unwrap=True):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _sharded_state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self._models[0], self._optimizers[0])
        return {"model": model_sd, "optim": optim_sd}

    @contextlib.contextmanager
    def _without_model_and_optimizer(self):
        saved = self._models, self._optimizers
        self._models, self._optimizers = [], []
        try:
            yield
        finally:
            self._models, self._optimizers = saved

    def save_state(self, output_dir=None, **kwargs):
        import torch.distributed.checkpoint as dcp

        with self._without_model_and_optimizer():  # scheduler, RNG of every rank
            out = super().save_state(output_dir, **kwargs)
        dcp.save(self._sharded_state(), checkpoint_id=os.path.join(output_dir, "fsdp2"))
        return out

    def load_state(self, input_dir=None, **kwargs):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        with self._without_model_and_optimizer():
            super().load_state(input_dir, **kwargs)
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=os.path.join(input_dir, "fsdp2"))
        set_state_dict(self._models[0], self._optimizers[0], model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

