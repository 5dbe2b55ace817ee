"""Entry used by train.py: build the components, fit, report where the outputs went."""
from __future__ import annotations

from omegaconf import DictConfig

from specdistill.build import build
from specdistill.eval.in_training import spec_eval_hook
from specdistill.train.loop import FitResult, fit


def run(cfg: DictConfig) -> FitResult:
    c = build(cfg)
    result = fit(c, epoch_end_hooks=(spec_eval_hook,))
    c.accelerator.print(f"[train] done at step {result.step}; checkpoint: {result.final_checkpoint}")
    return result
