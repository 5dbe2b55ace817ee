"""Training objectives, one file each; every objective is a dataclass whose __call__(batch, models) -> StepOutput."""
from specdistill.objectives.base import Models, StepOutput
from specdistill.objectives.draft_opd import DraftOPDObjective
from specdistill.objectives.eagle3 import Eagle3Objective
from specdistill.objectives.kd import KDObjective
from specdistill.objectives.moe_kd import MoEKDObjective
from specdistill.objectives.moe_opd import MoEOPDObjective
from specdistill.objectives.sft import SFTObjective

OBJECTIVES = {"sft": SFTObjective, "kd": KDObjective, "eagle3": Eagle3Objective}
OBJECTIVES["draft_opd"] = DraftOPDObjective
OBJECTIVES["moe_kd"] = MoEKDObjective
OBJECTIVES["moe_opd"] = MoEOPDObjective

__all__ = ["OBJECTIVES", "Models", "StepOutput", "KDObjective", "SFTObjective", "Eagle3Objective"]
