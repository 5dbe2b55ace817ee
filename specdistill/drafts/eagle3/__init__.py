"""EAGLE-3 heads: the model (the serving engines' midlayer layout), its drafter in the decoding core, its adapter and
export."""
from specdistill.drafts.eagle3.adapter import Eagle3Draft
from specdistill.drafts.eagle3.drafter import Eagle3Drafter
from specdistill.drafts.eagle3.model import Eagle3Config, Eagle3Head, build_eagle3, default_aux_layer_ids

__all__ = ["Eagle3Config", "Eagle3Draft", "Eagle3Drafter", "Eagle3Head", "build_eagle3", "default_aux_layer_ids"]
