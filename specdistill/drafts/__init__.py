"""Draft kinds behind one interface (drafts/base.py), each registered with its spec (drafts/registry.py): standalone
LMs (lm.py), EAGLE-3 heads (eagle3/) and DFlash block drafters (dflash/). Importing this package registers them; a new
kind is one folder (model, drafter, adapter with its register_kind, export) imported here."""
from __future__ import annotations

from specdistill.drafts.base import DraftAdapter
from specdistill.drafts.dflash import DFlashDraftKind
from specdistill.drafts.eagle3 import Eagle3Draft
from specdistill.drafts.lm import LMDraft
from specdistill.drafts.registry import (DraftKind, check_readable, draft_adapter, export_formats, exported_kind,
                                         kind_for_init, kind_named, load_trained_draft, reads_draft_path, register_kind,
                                         registered, saved_kind)

__all__ = ["DFlashDraftKind", "DraftAdapter", "DraftKind", "Eagle3Draft", "LMDraft", "check_readable", "draft_adapter",
           "export_formats", "exported_kind", "kind_for_init", "kind_named", "load_trained_draft", "reads_draft_path",
           "register_kind", "registered", "saved_kind"]
