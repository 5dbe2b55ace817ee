"""The held-out proxy of a training run read back from its logs: every held-out evaluation the loop wrote to
metrics.jsonl, at its step's training tokens and wall clock, and the untrained draft's from summary.json.

Reads files only (no torch, no models). The loop writes a step's training line (tokens_seen, wall_s) before that
step's evaluation lines, so an evaluation takes the counters of the last training line above it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

TAU_KEY = "heldout/mean_accept_len"  # simulated tau: teacher-forced greedy chains on held-out conversations


@dataclass
class HeldoutPoint:
    step: int
    tokens_seen: int  # loss tokens trained on, all ranks
    wall_s: float  # the training loop's wall clock at this step (evaluation and checkpoint time included)
    heldout_tau: float  # heldout/mean_accept_len
    accept_rate_per_pos: list[float]  # heldout a_k, k = 1..gamma
    phase: str  # the training phase evaluated (Draft-OPD: warmup, then main); "before" for the untrained draft
    num_positions: int = 0  # held-out positions scored (heldout/num_positions; 0 where not logged)


@dataclass
class HeldoutLog:
    points: list[HeldoutPoint] = field(default_factory=list)  # in log order; the "before" point first when read
    last_step: Optional[int] = None  # the last step metrics.jsonl logged
    tokens_seen: Optional[int] = None  # at the last training line
    wall_s: Optional[float] = None  # at the last training line


def _point(m: dict, step: int, tokens_seen: int, wall_s: float, phase: str) -> HeldoutPoint:
    return HeldoutPoint(step, tokens_seen, wall_s, float(m[TAU_KEY]), list(m.get("heldout/accept_rate_per_pos", [])),
                        phase, int(m.get("heldout/num_positions", 0)))


def read_heldout_log(run_dir, before: bool = True) -> HeldoutLog:
    """The held-out evaluations of the run in `run_dir` (trainer.output_dir). before: start with the untrained
    draft's point (summary.json heldout_before, at step 0, 0 tokens, 0 s) when the run logged one. Evaluations
    logged before any training line (no tokens_seen yet) are left out."""
    run_dir = Path(run_dir)
    log = HeldoutLog()
    summary = run_dir / "summary.json"
    untrained = (json.loads(summary.read_text()).get("heldout_before") or {}) if before and summary.exists() else {}
    if TAU_KEY in untrained:
        log.points.append(_point(untrained, 0, 0, 0.0, "before"))
    seen: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line) if line.strip() else {}
        seen.update({k: m[k] for k in ("tokens_seen", "wall_s") if k in m})
        log.last_step = m.get("step", log.last_step)
        if TAU_KEY in m and "tokens_seen" in seen:
            log.points.append(_point(m, int(m["step"]), int(seen["tokens_seen"]), float(seen.get("wall_s", 0.0)),
                                     str(m.get("phase", ""))))
    log.tokens_seen, log.wall_s = seen.get("tokens_seen"), seen.get("wall_s")
    return log
