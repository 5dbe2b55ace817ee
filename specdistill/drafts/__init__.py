"""Draft kinds behind one interface (drafts/base.py): standalone LMs (lm.py), EAGLE-3 heads (eagle3/) and DFlash block
drafters (dflash/). A new kind is one folder (model, drafter, adapter, export), its adapter listed in KINDS."""
from __future__ import annotations

import torch

from specdistill.drafts.base import DraftAdapter
from specdistill.drafts.dflash import DFlashDraftKind
from specdistill.drafts.eagle3 import Eagle3Draft
from specdistill.drafts.lm import LMDraft
from specdistill.tensors import unwrap

# first match wins: LMDraft takes any causal LM
KINDS: tuple[type[DraftAdapter], ...] = (Eagle3Draft, DFlashDraftKind, LMDraft)


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


def reads_draft_path(init: str) -> bool:
    """Whether `draft.init=<init>` reads draft.path (a pretrained draft, a warm-started head)."""
    return init in kind_for_init(init).path_inits


def saved_kind(path) -> type[DraftAdapter]:
    """The draft kind saved in a draft folder written by training (checkpoint/draft)."""
    return next(kind for kind in KINDS if kind.saved_in(path))  # LMDraft takes any folder


def load_trained_draft(path) -> torch.nn.Module:
    """A draft folder written by training, loaded by its kind's adapter (an EAGLE-3 head, a standalone HF LM)."""
    return saved_kind(path).load(path)


__all__ = ["KINDS", "DFlashDraftKind", "DraftAdapter", "Eagle3Draft", "LMDraft", "draft_adapter", "kind_for_init",
           "load_trained_draft", "reads_draft_path", "saved_kind"]
