"""DFlash block drafters: the model (vLLM's DFlash layout), its drafter in the decoding core, its adapter and export."""
from specdistill.drafts.dflash.adapter import DFlashDraftKind
from specdistill.drafts.dflash.drafter import DFlashDrafter
from specdistill.drafts.dflash.model import DFlashConfig, DFlashDraft, build_dflash

__all__ = ["DFlashConfig", "DFlashDraft", "DFlashDraftKind", "DFlashDrafter", "build_dflash"]
