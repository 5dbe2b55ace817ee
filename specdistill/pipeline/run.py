"""The training pipeline train.py runs: regenerate (optional) -> build -> fit (speculative eval at each epoch end, hub
push after each epoch's checkpoint and at the end) -> final speculative eval -> serving export."""
from __future__ import annotations

from omegaconf import DictConfig

from specdistill.build import build
from specdistill.drafts import kind_for_init
from specdistill.train.spec_eval import final_spec_eval, spec_eval_hook
from specdistill.hub.push import HubPusher, check_hub_config
from specdistill.pipeline.regenerate import build_regenerated_data
from specdistill.threads import configure_threads
from specdistill.train.distributed import check_replicas, make_launch_accelerator
from specdistill.train.loop import FitResult, fit


def run(cfg: DictConfig) -> FitResult:
    check_hub_config(cfg.hub)  # before any model is loaded
    check_export_config(cfg)
    acc = make_launch_accelerator(cfg)
    configure_threads(cfg.trainer.threads, "trainer.threads", log=acc.print)  # deliberate, printed (threads.py)
    c = build_components(cfg, accelerator=acc)
    pusher = HubPusher(cfg, c.output_dir, is_main=acc.is_main_process, log=acc.print)
    result = fit(c, epoch_end_hooks=(spec_eval_hook,), checkpoint_hooks=(pusher,) if cfg.hub.push else ())
    if result.nothing_to_do:  # a finished run: no eval, export or push rewrites its results
        return result
    pusher.finish(wait=result.preempted is None)
    check_replicas(acc, c.models.draft)
    if result.preempted is None and result.final_checkpoint is not None:
        final_spec_eval(c, epoch=-1, step=result.step)  # eval.spec_eval_at=end: the full benchmark, once
        if acc.is_main_process:
            export_final(cfg, result.final_checkpoint, c.output_dir, log=acc.print)
    if result.preempted:
        acc.print(f"[train] stopped by {result.preempted} at step {result.step}; resumable checkpoint: "
                  f"{result.final_checkpoint}")
    else:
        acc.print(f"[train] done at step {result.step}; checkpoint: {result.final_checkpoint}")
    return result


def build_components(cfg: DictConfig, accelerator=None):
    """build.build with the pipeline's first stage: data.regenerate.enabled regenerates the data with the target."""
    return build(cfg, accelerator=accelerator,
                 make_data=build_regenerated_data if cfg.data.regenerate.enabled else None)


def export_final(cfg: DictConfig, checkpoint, output_dir, log=print) -> list:
    """trainer.export_formats: serving exports of the final checkpoint's draft, validated, in <output_dir>/export/."""
    kind = kind_for_init(cfg.draft.init)
    written = []
    for fmt in cfg.trainer.export_formats or []:
        res = kind.export(checkpoint / "draft", output_dir / "export" / fmt, fmt=fmt, target_path=str(cfg.target.path),
                          overwrite=True)
        log(f"[export] {fmt}: {res.out_dir}")
        written.append(res.out_dir)
    return written


def check_export_config(cfg: DictConfig) -> None:
    from specdistill.export import FORMATS

    formats = list(cfg.trainer.export_formats or [])
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"trainer.export_formats {bad}: choose from {list(FORMATS)}")
    if formats and not kind_for_init(cfg.draft.init).serving_formats:
        raise ValueError(f"trainer.export_formats={formats} exports EAGLE-3 heads; draft.init={cfg.draft.init!r} is a "
                         "standalone LM (serve its checkpoint folder as is): set trainer.export_formats=[]")
    if cfg.eval.spec_eval_at not in ("every_epoch", "end"):
        raise ValueError(f"eval.spec_eval_at={cfg.eval.spec_eval_at!r}: choose every_epoch or end")
