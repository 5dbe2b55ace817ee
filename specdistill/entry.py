"""From Hydra's composed config to the typed Config every layer reads: checked and converted once, at the entry.

Knows nothing about models or data. The commands (cli/, pipeline.run, eval.run, scripts) call load_config on what
Hydra composed; below them every layer takes the typed Config or only its part of it (a TrainerConfig, an EvalConfig).
"""
from __future__ import annotations

from typing import Callable, Optional

from omegaconf import DictConfig, OmegaConf

from specdistill.config import Config
from specdistill.objectives import make_objective
from specdistill.phases import warmup_objective
from specdistill.validation import checked_config


def load_config(composed: DictConfig, log: Optional[Callable[[str], None]] = print) -> Config:
    """The composed config checked (validation.checked_config: composition, fields, cross-field; warnings logged),
    then its objectives as their dataclasses: `objective`, and in `warmup.objective` the warm-up phase's (None when
    no warm-up runs). A bad objective or phase setting fails here, naming the key and the fix."""
    cfg = checked_config(composed, log)
    cfg.warmup.objective = warmup_objective(cfg)
    cfg.objective = make_objective(cfg.objective, "objective")
    return cfg


def config_yaml(composed: DictConfig) -> str:
    """The composed config, resolved, as <output_dir>/config.yaml and every checkpoint hold it (what a resume
    compares)."""
    return OmegaConf.to_yaml(composed, resolve=True)
