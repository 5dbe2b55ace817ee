"""Training objectives, one file each; every objective is a dataclass whose __call__(batch, models) -> StepOutput."""
from typing import Any

from omegaconf import OmegaConf

from specdistill.objectives.base import Models, Objective, StepOutput
from specdistill.objectives.dflash import DFlashObjective
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
OBJECTIVES["dflash"] = DFlashObjective


def make_objective(raw: Any, key: str = "objective") -> Objective:
    """An objective's dataclass from a mapping with a `name` (the composed `objective`, or a phase's:
    warmup.objective), converted once at the entry (entry.load_config); `key` names the config key in the
    errors."""
    if not isinstance(raw, dict) or "name" not in raw:
        raise ValueError(f"{key} must be a mapping with a `name`; pick one with {key}=<name>, "
                         f"one of {sorted(OBJECTIVES)}")
    name = raw["name"]
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {key}.name={name!r}; choose one of {sorted(OBJECTIVES)}")
    cls = OBJECTIVES[name]
    schema = OmegaConf.structured(cls)
    OmegaConf.set_struct(schema, True)
    try:
        merged = OmegaConf.merge(schema, raw)
    except Exception as e:  # omegaconf's ConfigKeyError / ValidationError
        known = sorted(k for k in schema.keys())
        raise ValueError(f"bad {key} config for {name!r}: {e}. Known keys: {known}") from None
    return OmegaConf.to_object(merged)


__all__ = ["OBJECTIVES", "make_objective", "Models", "StepOutput", "KDObjective", "SFTObjective",
           "Eagle3Objective"]
