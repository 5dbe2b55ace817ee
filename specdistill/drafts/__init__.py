"""Draft kinds behind one interface (drafts/base.py): standalone LMs and EAGLE-3 heads. A new kind is one file,
listed in KINDS."""
from __future__ import annotations

import torch

from specdistill.drafts.base import DraftAdapter
from specdistill.drafts.eagle3 import Eagle3Draft
from specdistill.drafts.lm import LMDraft
from specdistill.tensors import unwrap

KINDS: tuple[type[DraftAdapter], ...] = (Eagle3Draft, LMDraft)  # first match wins: LMDraft takes any causal LM


def draft_adapter(model: torch.nn.Module) -> DraftAdapter:
    """The adapter for a built draft (bare or inside a DDP / accelerate wrapper)."""
    inner = unwrap(model)
    for kind in KINDS:
        if kind.matches(inner):
            return kind(model)
    raise TypeError(f"no draft kind handles a {type(inner).__name__}")


def kind_for_init(init: str) -> type[DraftAdapter]:
    """The draft kind that `draft.init=<init>` builds (an unknown init goes to LMDraft, whose builder names the
    valid ones)."""
    return next((kind for kind in KINDS if init in kind.inits), LMDraft)


__all__ = ["KINDS", "DraftAdapter", "Eagle3Draft", "LMDraft", "draft_adapter", "kind_for_init"]
