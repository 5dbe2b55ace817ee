"""The training pipeline train.py runs: regenerate (optional) -> build -> fit (speculative eval at each epoch end, hub
push after each epoch's checkpoint and at the end) -> final speculative eval -> serving export.

Every stage resumes. Training resumes from its checkpoints; each stage after it (eval/final, export/<format>) is
recorded in <output_dir>/stages.json once its files are complete, with the step of the checkpoint it was made from.
`trainer.resume=auto` on a run whose training is done runs whichever of those stages is missing or unrecorded (a
stage killed halfway is redone from scratch), so an interrupted run ends with the files of an uninterrupted one; with
hub.push, a final push that failed is made again (hub/push).
One process writes into trainer.output_dir at a time (files.folder_lock).
"""
from __future__ import annotations

import json
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional

from omegaconf import DictConfig

from specdistill.build import build
from specdistill.drafts import kind_for_init
from specdistill.files import check_writable, folder_lock, named_writes, write_text_atomic
from specdistill.train.spec_eval import final_spec_eval, spec_eval_hook
from specdistill.hub.push import HubPusher, PushFailed, check_hub_access, check_hub_config
from specdistill.pipeline.regenerate import build_regenerated_data
from specdistill.threads import configure_threads
from specdistill.train.distributed import check_replicas, make_launch_accelerator
from specdistill.train.loop import FitResult, fit

STAGES_FILE = "stages.json"
HUB_STAGE = "hub/push"  # recorded when the final checkpoint's push succeeded (no folder of its own)


def run(cfg: DictConfig) -> FitResult:
    check_hub_config(cfg.hub)  # before any model is loaded
    check_export_config(cfg)
    acc = make_launch_accelerator(cfg)
    configure_threads(cfg.trainer.threads, "trainer.threads", log=acc.print)  # deliberate, printed (threads.py)
    out_dir = Path(cfg.trainer.output_dir)
    lock = folder_lock(out_dir, "trainer.output_dir", log=acc.print) if acc.is_main_process else nullcontext()
    with lock:
        if acc.is_main_process:
            check_writable_folders(cfg)  # before minutes of conversion, tokenizing or regeneration
        if cfg.hub.push:
            check_hub_access(cfg.hub, log=acc.print)  # before training: a push that cannot happen fails now
        c = build_components(cfg, accelerator=acc)
        pusher = HubPusher(cfg, c.output_dir, is_main=acc.is_main_process, log=acc.print)
        with named_writes(c.output_dir, "trainer.output_dir", lambda: kept_checkpoint(c.output_dir)):
            result = fit(c, epoch_end_hooks=(spec_eval_hook,), checkpoint_hooks=(pusher,) if cfg.hub.push else ())
        if result.nothing_to_do:  # training is done: only stages that are missing or incomplete run
            todo = pending_stages(cfg, c.output_dir, result.step)
            if not todo:
                return result
            acc.print(f"[train] training is done; finishing the stages that did not complete: {', '.join(todo)}")
            from specdistill.train.checkpoint import load_checkpoint

            load_checkpoint(acc, result.final_checkpoint, c.phases)  # the draft as the run ended
            if HUB_STAGE in todo:
                push_final(pusher, c, result.final_checkpoint, result.step)
        else:
            pusher.finish(wait=result.preempted is None)
            check_replicas(acc, c.models.draft)
        if result.preempted is None and result.final_checkpoint is not None:
            final_stages(cfg, c, result.final_checkpoint, result.step)
            if acc.is_main_process and any(r.final and r.ok for r in pusher.records):
                record_stage(c.output_dir, HUB_STAGE, result.step, result.final_checkpoint)
        if result.preempted:
            acc.print(f"[train] stopped by {result.preempted} at step {result.step}; resumable checkpoint: "
                      f"{result.final_checkpoint}")
        else:
            acc.print(f"[train] done at step {result.step}; checkpoint: {result.final_checkpoint}")
        failed = [r for r in pusher.records if not r.ok]
        if failed:  # asked for and not done: the run did not do its job
            raise PushFailed(f"hub.push=true: {len(failed)} of {len(pusher.records)} pushes to {cfg.hub.repo_id} "
                             f"failed (last: {failed[-1].error}). The checkpoint {result.final_checkpoint} is kept; "
                             f"upload it with `hf upload {cfg.hub.repo_id} {failed[-1].staging}` (its staged folder), "
                             f"or fix the access and run again with trainer.resume=auto, which pushes it (see "
                             f"{pusher.root / 'push_log.jsonl'})")
    return result


def build_components(cfg: DictConfig, accelerator=None):
    """build.build with the pipeline's first stage: data.regenerate.enabled regenerates the data with the target."""
    return build(cfg, accelerator=accelerator,
                 make_data=build_regenerated_data if cfg.data.regenerate.enabled else None)


def kept_checkpoint(output_dir) -> str:
    """What a run that failed to write still has: its newest complete checkpoint, if any."""
    from specdistill.train.checkpoint import list_checkpoints

    done = list_checkpoints(output_dir)
    return (f"The newest complete checkpoint {done[-1]} is kept: continue from it with trainer.resume=auto" if done
            else "No checkpoint was complete yet")


def check_writable_folders(cfg: DictConfig) -> None:
    """The folders a run writes into, each probed before any work: the output folder, the data cache, the regenerated
    store (data.regenerate.enabled) and (for an embedded target, converted once) SPECDISTILL_CACHE."""
    from specdistill.assets import CACHE_ROOT, is_embedded

    check_writable(cfg.trainer.output_dir, "trainer.output_dir")
    check_writable(cfg.data.cache_dir, "data.cache_dir")
    if cfg.data.regenerate.enabled:
        check_writable(cfg.data.regenerate.store_dir, "data.regenerate.store_dir")
    if is_embedded(str(cfg.target.path)):
        check_writable(CACHE_ROOT, "the environment variable SPECDISTILL_CACHE")


# ---------------------------------------------------------------------------------------- stages after training
def stage_names(cfg: DictConfig) -> list[str]:
    """The stages that follow training, in order: eval/final (eval.spec_eval_at=end), export/<format> per
    trainer.export_formats, and hub/push (hub.push: the final checkpoint's push, done by fit's checkpoint hook)."""
    names = ["eval/final"] if cfg.eval.spec_eval and cfg.eval.spec_eval_at == "end" else []
    names += [f"export/{fmt}" for fmt in served_formats(cfg)]
    return names + ([HUB_STAGE] if cfg.hub.push else [])


def read_stages(output_dir) -> dict:
    f = Path(output_dir) / STAGES_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return {}  # absent, or unreadable: every stage runs again


def pending_stages(cfg: DictConfig, output_dir, step: int) -> list[str]:
    """The stages not recorded complete for the checkpoint at `step` (or whose folder is gone). A run folder written
    before stages were recorded (no stages.json) keeps the stage folders that are complete by construction: exports
    (renamed into place whole) and an eval/final holding every report file."""
    out = Path(output_dir)
    if not (out / STAGES_FILE).exists():
        return [n for n in stage_names(cfg) if not _complete_without_record(out, n)]
    done = read_stages(out)
    return [n for n in stage_names(cfg)
            if done.get(n, {}).get("step") != step or (n != HUB_STAGE and not (out / n).exists())]


def _complete_without_record(output_dir: Path, name: str) -> bool:
    from specdistill.eval.report import PLOTS

    folder = output_dir / name
    if name.startswith("export/"):
        return (folder / "config.json").exists()
    if name == "eval/final":  # the report writes its plots last
        return all((folder / f).exists() for f in ("results.json", "results.md", "outputs.jsonl", *PLOTS))
    log = output_dir / "hub" / "push_log.jsonl"  # HUB_STAGE: the push log says whether the final push went through
    lines = log.read_text().splitlines() if log.exists() else []
    return any(r.get("final") and r.get("ok") for r in map(_json_or_empty, lines))


def _json_or_empty(line: str) -> dict:
    try:
        return json.loads(line)
    except ValueError:
        return {}


def record_stage(output_dir, name: str, step: int, checkpoint) -> None:
    """Mark stage `name` complete (its files are all written) for the checkpoint at `step`."""
    stages = read_stages(output_dir)
    stages[name] = {"step": step, "checkpoint": str(checkpoint)}
    write_text_atomic(Path(output_dir) / STAGES_FILE, json.dumps(stages, indent=1))


def final_stages(cfg: DictConfig, c, checkpoint: Path, step: int) -> None:
    """Run the pending stages after training, each from scratch (a half-written folder of an interrupted stage is
    removed first) and recorded only once complete. Every rank calls this (the final eval has a barrier)."""
    acc = c.accelerator
    todo = [n for n in pending_stages(cfg, c.output_dir, step) if n != HUB_STAGE]
    acc.wait_for_everyone()  # every rank read the same record before the main process changes it
    for name in todo:
        folder = c.output_dir / name
        if acc.is_main_process and folder.exists():
            shutil.rmtree(folder)  # an interrupted stage's partial files
        acc.wait_for_everyone()
        if name == "eval/final":
            with named_writes(folder.parent, "trainer.output_dir", f"the checkpoint {checkpoint} is complete; "
                              "trainer.resume=auto runs the evaluation again"):
                final_spec_eval(c, epoch=-1, step=step)  # eval.spec_eval_at=end: the full benchmark, once
        elif acc.is_main_process:
            export_final(cfg, checkpoint, c.output_dir, formats=[name.split("/", 1)[1]], log=acc.print)
        if acc.is_main_process:
            record_stage(c.output_dir, name, step, checkpoint)
        acc.wait_for_everyone()


def push_final(pusher: HubPusher, c, checkpoint: Path, step: int) -> None:
    """The final checkpoint's hub push, for a resumed run whose training is done but whose last push failed or never
    ran (waits for the upload; pusher.records says how it went)."""
    from specdistill.drafts import draft_adapter

    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    metrics_file = Path(checkpoint) / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    if c.accelerator.is_main_process:
        kind = type(draft_adapter(c.accelerator.unwrap_model(c.models.draft)))
        pusher.push(Path(checkpoint), step, int(state.get("epoch", 0)), True, metrics, kind)


def export_final(cfg: DictConfig, checkpoint, output_dir, formats: Optional[list[str]] = None,
                 log: Callable[[str], None] = print) -> list:
    """trainer.export_formats (or `formats`): serving exports of the final checkpoint's draft, validated, in
    <output_dir>/export/."""
    kind = kind_for_init(cfg.draft.init)
    written = []
    for fmt in served_formats(cfg) if formats is None else formats:
        out = Path(output_dir) / "export" / fmt
        with named_writes(out.parent, "trainer.output_dir", f"the checkpoint {checkpoint} is complete; export it "
                          f"again with scripts/export.py or trainer.resume=auto"):
            res = kind.export(Path(checkpoint) / "draft", out, fmt=fmt, target_path=str(cfg.target.path),
                              overwrite=True)
        log(f"[export] {fmt}: {res.out_dir}")
        written.append(res.out_dir)
    return written


def served_formats(cfg: DictConfig) -> list[str]:
    """trainer.export_formats that the draft kind has a layout for (a DFlash draft: vllm only); the others are skipped
    with a note at the start (check_export_config), so one recipe serves every kind it trains."""
    kind = kind_for_init(cfg.draft.init)
    return [f for f in cfg.trainer.export_formats or [] if f in kind.serving_formats]


def check_export_config(cfg: DictConfig) -> None:
    from specdistill.export import FORMATS

    formats = list(cfg.trainer.export_formats or [])
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"trainer.export_formats {bad}: choose from {list(FORMATS)}")
    if formats and not kind_for_init(cfg.draft.init).serving_formats:
        raise ValueError(f"trainer.export_formats={formats} exports EAGLE-3 heads; draft.init={cfg.draft.init!r} is a "
                         "standalone LM (serve its checkpoint folder as is): set trainer.export_formats=[]")
    skipped = [f for f in formats if f not in served_formats(cfg)]
    if skipped and kind_for_init(cfg.draft.init).serving_formats:
        print(f"[export] trainer.export_formats {skipped} skipped: a draft.init={cfg.draft.init} draft exports to "
              f"{list(kind_for_init(cfg.draft.init).serving_formats)} only")
    if cfg.eval.spec_eval_at not in ("every_epoch", "end"):
        raise ValueError(f"eval.spec_eval_at={cfg.eval.spec_eval_at!r}: choose every_epoch or end")
