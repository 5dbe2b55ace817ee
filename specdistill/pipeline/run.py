"""The training pipeline train.py runs: regenerate (optional) -> build -> fit (speculative eval at each epoch end, hub
push after each epoch's checkpoint and at the end) -> final speculative eval -> serving export.

Every stage resumes. Training resumes from its checkpoints; each stage after it (eval/final, export/<format>) is
recorded in <output_dir>/stages.json once its files are complete, with the step of the checkpoint it was made from
and the size and SHA-256 of every file it wrote. `trainer.resume=auto` on a run whose training is done runs whichever
of those stages is unrecorded or whose files are missing or changed (a stage killed halfway is redone from scratch),
so an interrupted run ends with the files of an uninterrupted one; with hub.push, a final push that failed is made
again (hub/push). A finished run resumed with other eval settings makes that evaluation into eval/final-<digest of
the settings>, beside eval/final.
One process writes into trainer.output_dir at a time (files.folder_lock), and a folder belongs to the run that first
wrote into it: a fresh run into a folder holding another run's files is refused, checkpoint or not
(check_folder_claim); trainer.resume=auto on a run that stopped before its first checkpoint starts it over with its
files moved into <output_dir>/earlier-<UTC time>/ (move_earlier_run). A resume whose inputs (data, target,
tokenizer) changed content since its checkpoint is refused by name (train/inputs.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional

import yaml
from omegaconf import DictConfig

from specdistill.build import Components, assemble
from specdistill.config import Config, TrainerConfig
from specdistill.drafts import kind_for_init
from specdistill.files import LOCK_FILE, check_writable, folder_lock, named_writes, write_text_atomic
from specdistill.train.spec_eval import final_spec_eval, run_spec_eval, spec_eval_hook
from specdistill.hub.push import HubPusher, PushFailed, check_hub_access, check_hub_config
from specdistill.pipeline.regenerate import build_regenerated_data
from specdistill.threads import configure_threads
from specdistill.train.distributed import check_replicas, make_launch_accelerator
from specdistill.train.loop import FitResult, fit
from specdistill.entry import config_yaml, load_config
from specdistill.validation import log_warnings

STAGES_FILE = "stages.json"
HUB_STAGE = "hub/push"  # recorded when the final checkpoint's push succeeded (no folder of its own)
FINAL_EVAL = "eval/final"
# A run's own files in trainer.output_dir (the first, config.yaml, is written as training starts): a folder holding any
# of them belongs to that run
CLAIM_FILES = ("config.yaml", "metrics.jsonl", "data_report.json", "summary.json", STAGES_FILE)
# eval.* keys that change neither what the final evaluation measures nor where it is written in the run folder
EVAL_KEYS_IGNORED = ("output_dir", "overwrite", "draft_path", "device", "threads", "spec_eval_at")


def run(composed: DictConfig) -> FitResult:
    """The pipeline for Hydra's composed config: checked and typed once here (entry.load_config); each stage
    reads the typed Config."""
    cfg, yaml_text = load_config(composed, log=None), config_yaml(composed)
    check_hub_config(cfg.hub)  # the serving formats a push stages, before any model is loaded
    check_export_config(cfg)
    acc = make_launch_accelerator(cfg.trainer)
    log_warnings(cfg, acc.print)
    configure_threads(cfg.trainer.threads, "trainer.threads", log=acc.print)  # deliberate, printed (threads.py)
    out_dir = Path(cfg.trainer.output_dir)
    lock = folder_lock(out_dir, "trainer.output_dir", log=acc.print) if acc.is_main_process else nullcontext()
    with lock:
        if acc.is_main_process:
            check_writable_folders(cfg)  # before minutes of conversion, tokenizing or regeneration
        aside = check_folder_claim(cfg.trainer, yaml_text, out_dir, log=acc.print)  # every process: reads only
        if aside is not None:  # a run started over: its earlier files are kept, moved aside by the main process
            acc.wait_for_everyone()
            if acc.is_main_process:
                move_earlier_run(out_dir, aside)
            acc.wait_for_everyone()
        if cfg.hub.push:
            check_hub_access(cfg.hub, log=acc.print)  # before training: a push that cannot happen fails now
        c = run_components(cfg, yaml_text, accelerator=acc)
        check_run_inputs(cfg, c)  # a resume over changed data, target or tokenizer is refused here
        pusher = HubPusher(cfg, c.output_dir, is_main=acc.is_main_process, log=acc.print)
        with named_writes(c.output_dir, "trainer.output_dir", lambda: kept_checkpoint(c.output_dir)):
            result = fit(c, epoch_end_hooks=(spec_eval_hook,), checkpoint_hooks=(pusher,) if cfg.hub.push else ())
        if result.nothing_to_do:  # training is done: only stages that are missing or incomplete run
            why = why_pending(cfg, c.output_dir, result.step)
            if not why:
                return result
            acc.print("[train] training is done; making the stages that are not complete: "
                      + "; ".join(f"{n} ({reason})" for n, reason in why.items()))
            todo = list(why)
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


def run_components(cfg: Config, config_yaml: str, accelerator=None) -> Components:
    """build.assemble with the pipeline's first stage: data.regenerate.enabled regenerates the data with the target."""
    return assemble(cfg, config_yaml, accelerator=accelerator,
                    make_data=build_regenerated_data if cfg.data.regenerate.enabled else None)


def build_components(composed: DictConfig, accelerator=None) -> Components:
    """run_components for Hydra's composed config, checked and typed once as run does (tests, scripts)."""
    return run_components(load_config(composed), config_yaml(composed), accelerator)


def kept_checkpoint(output_dir) -> str:
    """What a run that failed to write still has: its newest complete checkpoint, if any."""
    from specdistill.train.checkpoint import list_checkpoints

    done = list_checkpoints(output_dir)
    return (f"The newest complete checkpoint {done[-1]} is kept: continue from it with trainer.resume=auto" if done
            else "No checkpoint was complete yet")


def check_writable_folders(cfg: Config) -> None:
    """The folders a run writes into, each probed before any work: the output folder, the data cache, the regenerated
    store (data.regenerate.enabled) and (for an embedded target, converted once) SPECDISTILL_CACHE."""
    from specdistill.assets import CACHE_ROOT, is_embedded

    check_writable(cfg.trainer.output_dir, "trainer.output_dir")
    check_writable(cfg.data.cache_dir, "data.cache_dir")
    if cfg.data.regenerate.enabled:
        check_writable(cfg.data.regenerate.store_dir, "data.regenerate.store_dir")
    if is_embedded(str(cfg.target.path)):
        check_writable(CACHE_ROOT, "the environment variable SPECDISTILL_CACHE")


# ---------------------------------------------------------------------------------------- the run's folder and inputs
EARLIER_PREFIX = "earlier-"  # <output_dir>/earlier-<UTC time>/: the files of a run started over (move_earlier_run)


def check_folder_claim(t: TrainerConfig, config_yaml: str, out_dir,
                       log: Callable[[str], None] = print) -> Optional[Path]:
    """A folder belongs to the run that first wrote into it. A fresh run (trainer.resume=null) into a folder holding
    another run's files (CLAIM_FILES) is refused, naming them and the fixes, checkpoint or not; with checkpoints the
    training loop refuses it too. trainer.resume=auto in a folder whose run stopped before its first checkpoint starts
    that run over (said so), unless its config.yaml is another run's (a key that breaks exactness differs): returns
    the folder its files are to be moved into (move_earlier_run), else None. Reads only."""
    from specdistill.train.checkpoint import config_drift, list_checkpoints

    out = Path(out_dir)
    claimed = [str(out / n) for n in CLAIM_FILES if (out / n).exists()]
    if not claimed or (t.resume and list_checkpoints(out)):
        return None  # a new folder, or a resume with something to resume from
    aside = out / f"{EARLIER_PREFIX}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    if not t.resume:
        if list_checkpoints(out):
            held, fix = "and its checkpoints", "continue that run with trainer.resume=auto"
        else:
            held = "and no checkpoint (it stopped before its first save)"
            fix = f"start it over with trainer.resume=auto: its files are moved to {aside}/"
        raise FileExistsError(
            f"trainer.output_dir={out} belongs to another run: it holds {', '.join(claimed)} {held}; a fresh run would "
            f"replace them. Fix: write into another trainer.output_dir, or {fix}")
    if t.resume != "auto":
        return None  # trainer.resume=PATH: the folder continues that checkpoint's run
    old = out / "config.yaml"
    if old.exists():
        breaking = config_drift(old.read_text(), config_yaml).breaking
        if breaking and not t.resume_allow_drift:
            raise FileExistsError(
                f"trainer.resume=auto: trainer.output_dir={out} holds another run's files ({', '.join(claimed)}; its "
                f"config.yaml differs in {', '.join(breaking)}) and no checkpoint to resume from. Fix: write into "
                "another trainer.output_dir, or run again with that run's settings")
    log(f"[train] trainer.resume=auto: {out} has no checkpoint yet (its run stopped before its first save): the run "
        f"starts over at step 0; the earlier run's files ({', '.join(claimed)} and the rest of the folder) are moved "
        f"to {aside}/")
    return aside


def move_earlier_run(out_dir, aside: Path) -> Path:
    """Move everything in `out_dir` but its lock and earlier moves into `aside` (a fresh name: a second start-over
    within the same second gets a suffix); nothing is deleted. Returns the folder used."""
    out, dest, n = Path(out_dir), Path(aside), 1
    while dest.exists():
        n += 1
        dest = Path(f"{aside}-{n}")
    entries = [p for p in sorted(out.iterdir())
               if not p.name.startswith(LOCK_FILE) and not p.name.startswith(EARLIER_PREFIX)]
    dest.mkdir()
    for p in entries:
        os.replace(p, dest / p.name)
    return dest


def check_run_inputs(cfg: Config, c: Components) -> dict:
    """The run's inputs by content (train/inputs.py; hashed here, once per cache folder, before the first checkpoint
    records them). A resume from a checkpoint whose recorded inputs differ is refused by name, unless
    trainer.resume_accept_changed_inputs. Every process calls this (a sharded target's embeddings are gathered)."""
    from specdistill.ranks import caches_filled_once
    from specdistill.train.checkpoint import resolve_resume
    from specdistill.train.inputs import check_resume_inputs, run_inputs, target_embedding_digest

    acc, t = c.accelerator, cfg.trainer
    embeddings = target_embedding_digest(c.models.target)
    with caches_filled_once(acc):
        now = run_inputs(cfg.target, cfg.data, c.models.tokenizer, embeddings)
    try:
        checkpoint = resolve_resume(t.resume, c.output_dir)
    except FileNotFoundError:
        return now  # the training loop names a trainer.resume that is not a checkpoint
    if checkpoint is not None:
        check_resume_inputs(checkpoint, now, t.resume_accept_changed_inputs, log=acc.print)
    return now


# ---------------------------------------------------------------------------------------- stages after training
def stage_names(cfg: Config) -> list[str]:
    """The stages that follow training, in order: eval/final (eval.spec_eval_at=end), export/<format> per
    trainer.export_formats, and hub/push (hub.push: the final checkpoint's push, done by fit's checkpoint hook)."""
    names = [FINAL_EVAL] if cfg.eval.spec_eval and cfg.eval.spec_eval_at == "end" else []
    names += [f"export/{fmt}" for fmt in served_formats(cfg)]
    return names + ([HUB_STAGE] if cfg.hub.push else [])


def read_stages(output_dir) -> dict:
    f = Path(output_dir) / STAGES_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return {}  # absent, or unreadable: every stage runs again


def eval_settings(node: dict) -> dict:
    """The eval.* settings the final evaluation's results depend on (EVAL_KEYS_IGNORED left out), from eval's
    settings as a mapping (dataclasses.asdict of an EvalConfig, or the eval section of a config.yaml)."""
    return {k: v for k, v in node.items() if k not in EVAL_KEYS_IGNORED}


def settings_now(cfg: Config) -> dict:
    """eval_settings of the run's eval.* now."""
    return eval_settings(dataclasses.asdict(cfg.eval))


def recorded_eval_settings(output_dir, step: int) -> Optional[dict]:
    """The eval settings the checkpoint at `step` was evaluated with: eval/final's record in stages.json when it was
    made from that checkpoint, else the eval section of the checkpoint's config.yaml (the run's own, which its epoch
    evaluations used); None when neither says."""
    from specdistill.train.checkpoint import list_checkpoints

    rec = read_stages(output_dir).get(FINAL_EVAL, {})
    if rec.get("step") != step:
        rec = {}
    if "settings" in rec:
        return rec["settings"]
    ckpts = [Path(rec["checkpoint"])] if rec.get("checkpoint") else list_checkpoints(output_dir)[-1:]
    f = ckpts[0] / "config.yaml" if ckpts else None
    if f is None or not f.exists():
        return None
    return eval_settings(yaml.safe_load(f.read_text())["eval"])


def other_eval_stage(cfg: Config, output_dir, step: int) -> Optional[str]:
    """eval/final-<digest> when the run's evaluation settings now (eval.spec_eval) differ from those its evaluations
    of the checkpoint at `step` were made with (eval/final's, or with eval.spec_eval_at=every_epoch the checkpoint's
    config): the evaluation a finished run resumed with other settings asks for; else None (also while eval/final
    itself is still to be made, with the settings of now)."""
    if not cfg.eval.spec_eval:
        return None
    if FINAL_EVAL in stage_names(cfg) and stage_problem(output_dir, FINAL_EVAL, step) is not None:
        return None
    recorded, now = recorded_eval_settings(output_dir, step), settings_now(cfg)
    if recorded is None or recorded == now:
        return None
    digest = hashlib.sha256(json.dumps(now, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{FINAL_EVAL}-{digest}"


def settings_diff(recorded: dict, now: dict) -> str:
    """eval.k: a -> b, for each setting that differs."""
    keys = sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k))
    return ", ".join(f"eval.{k}: {recorded.get(k)!r} -> {now.get(k)!r}" for k in keys)


def stage_files(folder: Path) -> dict:
    """{relative path: {size, sha256}} of every file a stage wrote into `folder`."""
    from specdistill.cache import file_digest

    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": file_digest(p)}
            for p in sorted(folder.rglob("*")) if p.is_file()}


def stage_problem(output_dir, name: str, step: int) -> Optional[str]:
    """Why stage `name` is not complete for the checkpoint at `step` (None: it is): unrecorded, recorded for another
    checkpoint, or a file it wrote missing or changed since (its record's sizes and SHA-256). A run folder written
    before stages were recorded (no stages.json) keeps the stage folders that are complete by construction: exports
    (renamed into place whole) and an eval/final holding every report file."""
    out = Path(output_dir)
    if not (out / STAGES_FILE).exists():
        return None if _complete_without_record(out, name) else "not complete"
    rec = read_stages(out).get(name)
    if rec is None:
        return "not made yet"
    if rec.get("step") != step:
        return f"made from step {rec.get('step')}, not {step}"
    if name == HUB_STAGE:
        return None
    files = rec.get("files")
    if files is None:  # recorded without its files: the folder must hold what the stage writes
        return None if _complete_without_record(out, name) else f"{out / name} is incomplete"
    if not files:
        return f"{out / name} recorded no files"
    from specdistill.cache import file_digest

    for rel, meta in files.items():
        p = out / name / rel
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != meta["size"] or file_digest(p) != meta["sha256"]:
            return f"{p} changed since it was written"
    return None


def why_pending(cfg: Config, output_dir, step: int) -> dict[str, str]:
    """{stage: why it is not complete} for the checkpoint at `step`, in order; with other eval settings than those
    of a complete eval/final, the evaluation they ask for (other_eval_stage) too."""
    why = {n: p for n in stage_names(cfg) if (p := stage_problem(output_dir, n, step)) is not None}
    other = other_eval_stage(cfg, output_dir, step)
    if other is not None:
        problem = stage_problem(output_dir, other, step)
        if problem is not None:
            diff = settings_diff(recorded_eval_settings(output_dir, step) or {}, settings_now(cfg))
            why[other] = (f"{FINAL_EVAL} was made with other eval settings ({diff}); this evaluation goes into "
                          f"{Path(output_dir) / other}")
    return why


def pending_stages(cfg: Config, output_dir, step: int) -> list[str]:
    """The stages not complete for the checkpoint at `step` (why_pending), in order."""
    return list(why_pending(cfg, output_dir, step))


def _complete_without_record(output_dir: Path, name: str) -> bool:
    from specdistill.eval.report import PLOTS

    folder = output_dir / name
    if name.startswith("export/"):
        return (folder / "config.json").exists()
    if name == FINAL_EVAL:  # the report writes its plots last
        return all((folder / f).exists() for f in ("results.json", "results.md", "outputs.jsonl", *PLOTS))
    if name.startswith(FINAL_EVAL):  # eval/final-<digest>: no plots
        return all((folder / f).exists() for f in ("results.json", "results.md", "outputs.jsonl"))
    log = output_dir / "hub" / "push_log.jsonl"  # HUB_STAGE: the push log says whether the final push went through
    lines = log.read_text().splitlines() if log.exists() else []
    return any(r.get("final") and r.get("ok") for r in map(_json_or_empty, lines))


def _json_or_empty(line: str) -> dict:
    try:
        return json.loads(line)
    except ValueError:
        return {}


def record_stage(output_dir, name: str, step: int, checkpoint, settings: Optional[dict] = None) -> None:
    """Mark stage `name` complete (its files are all written) for the checkpoint at `step`, with the size and SHA-256
    of each of its files (a stage with a folder) and the settings it was made with (evaluations)."""
    stages = read_stages(output_dir)
    rec: dict = {"step": step, "checkpoint": str(checkpoint)}
    folder = Path(output_dir) / name
    if name != HUB_STAGE and folder.is_dir():
        rec["files"] = stage_files(folder)
    if settings is not None:
        rec["settings"] = settings
    stages[name] = rec
    write_text_atomic(Path(output_dir) / STAGES_FILE, json.dumps(stages, indent=1))


def final_stages(cfg: Config, c: Components, checkpoint: Path, step: int) -> None:
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
        settings = None
        if name.startswith(FINAL_EVAL):
            settings = settings_now(cfg)
            with named_writes(folder.parent, "trainer.output_dir", f"the checkpoint {checkpoint} is complete; "
                              "trainer.resume=auto runs the evaluation again"):
                if name == FINAL_EVAL:
                    final_spec_eval(c, epoch=-1, step=step)  # eval.spec_eval_at=end: the full benchmark, once
                else:  # other eval settings than eval/final's: their own folder
                    run_spec_eval(c, epoch=-1, step=step, name=Path(name).name)
        elif acc.is_main_process:
            export_final(cfg, checkpoint, c.output_dir, formats=[name.split("/", 1)[1]], log=acc.print)
        if acc.is_main_process:
            record_stage(c.output_dir, name, step, checkpoint, settings)
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


def export_final(cfg: Config, checkpoint, output_dir, formats: Optional[list[str]] = None,
                 log: Callable[[str], None] = print) -> list:
    """trainer.export_formats (or `formats`): serving exports of the final checkpoint's draft, validated, in
    <output_dir>/export/."""
    kind = kind_for_init(cfg.draft.init).spec
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


def served_formats(cfg: Config) -> list[str]:
    """trainer.export_formats that the draft kind has a layout for (a DFlash draft: vllm only); the others are skipped
    with a note at the start (check_export_config), so one recipe serves every kind it trains."""
    return [f for f in cfg.trainer.export_formats or [] if f in kind_for_init(cfg.draft.init).spec.formats]


def check_export_config(cfg: Config) -> None:
    from specdistill.drafts import export_formats

    formats = list(cfg.trainer.export_formats or [])
    bad = [f for f in formats if f not in export_formats()]
    if bad:
        raise ValueError(f"trainer.export_formats {bad}: choose from {list(export_formats())}")
    kind = kind_for_init(cfg.draft.init).spec
    if formats and not kind.formats:
        raise ValueError(f"trainer.export_formats={formats}: draft.init={cfg.draft.init!r} builds a {kind.name} draft, "
                         "which has no serving export format (serve its checkpoint folder as is): set "
                         "trainer.export_formats=[]")
    skipped = [f for f in formats if f not in served_formats(cfg)]
    if skipped and kind.formats:
        print(f"[export] trainer.export_formats {skipped} skipped: a draft.init={cfg.draft.init} draft exports to "
              f"{list(kind.formats)} only")
