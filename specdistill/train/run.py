"""Entry used by train.py: make the accelerator for the launch mode, build the components, fit (speculative eval at
each epoch end, hub push after each epoch's checkpoint and at the end), report where the outputs went."""
from __future__ import annotations

from omegaconf import DictConfig

from specdistill.build import build
from specdistill.eval.in_training import spec_eval_hook
from specdistill.hub.push import HubPusher, check_hub_config
from specdistill.train.distributed import check_replicas, make_launch_accelerator
from specdistill.train.loop import FitResult, fit


def run(cfg: DictConfig) -> FitResult:
    check_hub_config(cfg.hub)  # before any model is loaded
    acc = make_launch_accelerator(cfg)
    c = build(cfg, accelerator=acc)
    pusher = HubPusher(cfg, c.output_dir, is_main=acc.is_main_process, log=acc.print)
    result = fit(c, epoch_end_hooks=(spec_eval_hook,), checkpoint_hooks=(pusher,) if cfg.hub.push else ())
    pusher.finish(wait=result.preempted is None)
    check_replicas(acc, c.models.draft)
    if result.preempted:
        acc.print(f"[train] stopped by {result.preempted} at step {result.step}; resumable checkpoint: "
                  f"{result.final_checkpoint}")
    else:
        acc.print(f"[train] done at step {result.step}; checkpoint: {result.final_checkpoint}")
    return result
