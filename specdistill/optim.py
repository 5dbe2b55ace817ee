"""The draft's optimizer: AdamW (the default), or Muon on the hidden weight matrices with AdamW on everything else.

Muon (torch.optim.Muon) orthogonalises each 2-D update by Newton-Schulz iterations; it is defined for hidden weight
matrices only, so embeddings, the output head, norms and biases stay on AdamW, as speculators' trainer splits them.
torch ships no optimizer that holds both, so `MuonAdamW` holds the two and exposes their parameter groups as its own:
LR schedulers, gradient clipping, accelerate's wrapper and checkpoints see one optimizer.
"""
from __future__ import annotations

from typing import Iterable

import torch

# Parts of the names of 2-D parameters that are not hidden weight matrices: token embeddings and output heads.
ADAMW_ONLY = ("embed", "lm_head", "norm")


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """A parameter Muon updates: 2-D, and neither an embedding, an output head nor a norm."""
    return param.ndim == 2 and not any(k in name for k in ADAMW_ONLY)


class MuonAdamW(torch.optim.Optimizer):
    """Muon over `muon_params`, AdamW over `adamw_params`; one list of parameter groups (Muon's first).

    Each group is the inner optimizer's own dict, so a scheduler that sets group["lr"] sets it for the optimizer that
    steps it. state_dict() holds both inner states under "muon" and "adamw".
    """

    def __init__(self, muon_params: Iterable[torch.Tensor], adamw_params: Iterable[torch.Tensor], *, lr: float,
                 betas: tuple[float, float], weight_decay: float, momentum: float = 0.95,
                 muon_weight_decay: float = 0.1):
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        if not muon_params:
            raise ValueError("trainer.optimizer=muon: the draft has no hidden weight matrix for Muon to update; use "
                             "trainer.optimizer=adamw")
        # match_rms_adamw scales Muon's update to AdamW's RMS, so one lr serves both halves
        self.muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=muon_weight_decay, momentum=momentum,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw_params, lr=lr, betas=betas, weight_decay=weight_decay) \
            if adamw_params else None
        super().__init__([{"params": []}], {})
        self._link_groups()

    def _link_groups(self) -> None:
        """Expose the inner optimizers' own group dicts (not copies). torch's load_state_dict replaces an optimizer's
        group dicts with new ones, so every load links them again: accelerate's prepare() loads the state back once
        to place it on the device, and a stale link leaves the schedule setting an lr that no optimizer reads."""
        self.param_groups = self.muon.param_groups + (self.adamw.param_groups if self.adamw else [])

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.muon.step()
        if self.adamw:
            self.adamw.step()
        return loss

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError("this checkpoint's optimizer state is not trainer.optimizer=muon's; resume with the "
                             "optimizer it was trained with")
        self.muon.load_state_dict(state_dict["muon"])
        if self.adamw:
            self.adamw.load_state_dict(state_dict["adamw"])
        self._link_groups()


# Optimizers newer than the oldest torch a user may have installed: kind -> (attribute of torch.optim, first torch).
NEEDS_TORCH = {"muon": ("Muon", "2.9")}


def check_available(kind: str) -> None:
    """Refuse, by name and with the fix, an optimizer this torch does not ship (before any data or model loads)."""
    if kind in NEEDS_TORCH and not hasattr(torch.optim, NEEDS_TORCH[kind][0]):
        name, first = NEEDS_TORCH[kind]
        raise ValueError(f"trainer.optimizer={kind} needs torch.optim.{name}, which torch ships from {first} on; this "
                         f"torch is {torch.__version__}. Install torch>={first} or use trainer.optimizer=adamw")


def build_optimizer(model: torch.nn.Module, kind: str, *, lr: float, betas, weight_decay: float,
                    momentum: float = 0.95, muon_weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """The optimizer trainer.optimizer names over the model's trainable parameters."""
    check_available(kind)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    if kind == "muon":
        return MuonAdamW([p for n, p in named if is_hidden_matrix(n, p)],
                         [p for n, p in named if not is_hidden_matrix(n, p)],
                         lr=lr, betas=tuple(betas), weight_decay=weight_decay, momentum=momentum,
                         muon_weight_decay=muon_weight_decay)
    raise ValueError(f"trainer.optimizer={kind!r}: use adamw or muon")


def check_optimizer_backend(kind: str, accelerator) -> None:
    """Muon needs each weight matrix whole on every rank: refused under DeepSpeed (ZeRO flattens and partitions the
    parameters it steps) and FSDP (sharded parameters), before the target loads; an optimizer this torch lacks too."""
    check_available(kind)
    backend = f"{accelerator.distributed_type} {type(accelerator).__name__}".upper()
    if kind == "muon" and ("DEEPSPEED" in backend or "FSDP" in backend):
        raise ValueError(f"trainer.optimizer=muon under {accelerator.distributed_type}: Muon orthogonalises whole "
                         "weight matrices, which DeepSpeed and FSDP split across ranks; use DDP (or one process) for "
                         "Muon, or trainer.optimizer=adamw with this backend")
