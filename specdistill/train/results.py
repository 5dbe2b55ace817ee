"""Never overwrite results with less: a run that has nothing left to do leaves every result file as it is.

Re-running a finished run with trainer.resume=auto would otherwise rewrite summary.json with nulls (held-out
results, the final checkpoint) and restart metrics; `finished_run` recognises that case before anything is written.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

RESULT_FILES = ("summary.json", "metrics.jsonl", "config.yaml", "data_report.json")


def checkpoint_step(ckpt: Path) -> int:
    return int(json.loads((Path(ckpt) / "trainer_state.json").read_text())["step"])


def finished_run(resume_from: Optional[Path], max_steps: int, out_dir: Path):
    """A FitResult (nothing_to_do=True) when the checkpoint to resume from is already at max_steps, else None.
    The held-out results come back from the run's summary.json, which is left untouched."""
    from specdistill.train.loop import FitResult

    if resume_from is None:
        return None
    step = checkpoint_step(resume_from)
    if step < max_steps:
        return None
    summary = {}
    f = Path(out_dir) / "summary.json"
    if f.exists():
        try:
            summary = json.loads(f.read_text())
        except ValueError:
            summary = {}
    return FitResult(step, Path(resume_from), heldout_before=summary.get("heldout_before"),
                     heldout_after=summary.get("heldout_after"), nothing_to_do=True)


def nothing_to_do_message(result, out_dir: Path, max_steps: int) -> str:
    kept = [n for n in RESULT_FILES if (Path(out_dir) / n).exists()]
    return (f"[train] nothing to do: {result.final_checkpoint} is already at step {result.step} >= "
            f"trainer.max_steps={max_steps}. Left untouched: {', '.join(kept) or 'no result files'} "
            "(raise trainer.max_steps to train further)")


def drop_replayed(metrics_file: Path, resumed_at: int) -> int:
    """Before a resume from the checkpoint at step `resumed_at` appends to metrics.jsonl: remove the lines of later
    steps (written after that checkpoint by a run that was then killed), which the resume trains and logs again, so
    each step appears once. Rewritten atomically; returns how many lines were dropped."""
    from specdistill.files import write_text_atomic

    f = Path(metrics_file)
    if not f.exists():
        return 0
    kept, dropped = [], 0
    for line in f.read_text().splitlines():
        try:
            step = json.loads(line).get("step")
        except ValueError:
            step = None  # a line cut by the kill: dropped with the steps after the checkpoint
        if step is None or step > resumed_at:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        write_text_atomic(f, "".join(k + "\n" for k in kept))
    return dropped
