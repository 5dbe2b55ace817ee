"""Learning curves of several training runs, read from their logs (nothing decodes): one line per run.

  python scripts/learning_curves.py outputs/eagle3_serve outputs/dflash_serve --out outputs/curves
  python scripts/learning_curves.py outputs/a outputs/b --label outputs/a="EAGLE-3, KD" --out outputs/curves

Per run folder (trainer.output_dir):
  metrics.jsonl   the held-out proxy the trainer logs every trainer.eval_every steps: heldout/mean_accept_len, the
                  simulated tau of teacher-forced greedy chains of gamma drafts on held-out conversations
                  (eval/simulated.py), with the training tokens (tokens_seen) and wall seconds (wall_s) of its step
  summary.json    the held-out proxy before training (a point at 0 tokens, 0 s) and the training wall time
  config.yaml     run name, draft.init (-> the draft kind) and objective
  eval/final/results.json (when the run made one)   tau of real speculative decoding of the final draft on the
                  evaluation prompts and its wall-clock speedup: a star at the run's last point
Writes OUT/learning_curves.json, learning_curves.md and learning_curves.png (left: against training tokens, right:
against training wall time); the command line is recorded in the JSON and the md. scripts/learning_curve.py decodes
every checkpoint instead (real tau per checkpoint, one run).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from specdistill.train.heldout_log import HeldoutPoint, read_heldout_log

FILES = ("learning_curves.json", "learning_curves.md", "learning_curves.png")
TAU_NAME = "held-out simulated tau"  # what the lines are: the in-training proxy, not decoding


@dataclass
class FinalEval:
    """eval/final/results.json: real speculative decoding of the final draft."""
    tau: float  # mean_accept_len: tokens per target forward
    speedup: Optional[float]  # wall clock, prefill included; None when not measured
    gamma: int
    temperature: float
    num_prompts: int
    path: str


@dataclass
class RunCurve:
    run: str  # the run folder as given
    label: str  # the legend's name
    run_name: str
    draft_kind: str  # the draft adapter's kind (drafts/): "eagle3", "dflash", "draft" (a standalone LM)
    draft_init: str
    objective: str
    heldout_gamma: Optional[int]  # drafts per simulated chain
    train_wall_s: Optional[float]
    tokens_seen: Optional[int]  # at the last logged step
    steps: Optional[int]
    points: list[HeldoutPoint] = field(default_factory=list)
    final_heldout_tau: Optional[float] = None  # the last held-out proxy (summary.json heldout_after)
    final_eval: Optional[FinalEval] = None


def _read_json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.exists() else None


def _config(run: Path) -> dict:
    import yaml

    path = run / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: pass training run folders (trainer.output_dir), which hold "
                                "config.yaml, metrics.jsonl and summary.json")
    return yaml.safe_load(path.read_text()) or {}


def _final_eval(run: Path) -> Optional[FinalEval]:
    path = run / "eval" / "final" / "results.json"
    r = _read_json(path)
    if r is None or r.get("mean_accept_len") is None:
        return None
    speedup = r.get("speedup")
    if isinstance(speedup, float) and not math.isfinite(speedup):
        speedup = None
    return FinalEval(tau=float(r["mean_accept_len"]), speedup=speedup, gamma=int(r.get("gamma", 0)),
                     temperature=float(r.get("temperature", 0.0)), num_prompts=int(r.get("num_prompts", 0)),
                     path=str(path))


def read_run(run, label: Optional[str] = None) -> RunCurve:
    """One run's curve from its folder (see the module docstring)."""
    from specdistill.drafts import kind_for_init

    run = Path(run)
    cfg = _config(run)
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"{metrics} not found: the run has not logged a step yet")
    summary = _read_json(run / "summary.json") or {}
    init = str((cfg.get("draft") or {}).get("init", "?"))
    kind = kind_for_init(init).kind
    objective = str((cfg.get("objective") or {}).get("name", "?"))
    name = str(cfg.get("run_name") or run.name)
    log = read_heldout_log(run)
    points = log.points
    after = summary.get("heldout_after") or {}
    gammas = {len(p.accept_rate_per_pos) for p in points}
    return RunCurve(run=str(run), label=label or f"{name} ({kind} / {objective})", run_name=name, draft_kind=kind,
                    draft_init=init, objective=objective, heldout_gamma=gammas.pop() if len(gammas) == 1 else None,
                    train_wall_s=summary.get("wall_s", log.wall_s), tokens_seen=log.tokens_seen,
                    steps=summary.get("step", log.last_step), points=points,
                    final_heldout_tau=after.get("heldout/mean_accept_len",
                                                points[-1].heldout_tau if points else None),
                    final_eval=_final_eval(run))


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(curves: list[RunCurve], command: str) -> str:
    rows = ["| run | draft kind | draft.init | objective | train wall time | training tokens | "
            f"{TAU_NAME} (last) | final eval tau | final speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for c in curves:
        fe = c.final_eval
        wall = _duration(c.train_wall_s)
        tokens = "-" if c.tokens_seen is None else f"{c.tokens_seen:,}"
        tau = "-" if fe is None else f"{fe.tau:.3f} (gamma {fe.gamma}, T {fe.temperature:g}, {fe.num_prompts} prompts)"
        rows.append(f"| {c.label} | {c.draft_kind} | {c.draft_init} | {c.objective} | {wall} | {tokens} | "
                    f"{_f(c.final_heldout_tau)} | {tau} | {_f(fe.speedup if fe else None)} |")
    notes = (f"{TAU_NAME}: the trainer's in-training proxy (heldout/mean_accept_len in metrics.jsonl), tokens per "
             "target forward if the draft's teacher-forced greedy chains on held-out conversations were decoded; "
             "final eval tau and speedup: real speculative decoding of the final draft (eval/final/results.json).")
    return f"# Learning curves\n\n`{command}`\n\n" + "\n".join(rows) + f"\n\n{notes}\n"


def hand_overs(points: list[HeldoutPoint]) -> list[int]:
    """Indices of the points at a hand-over: the last evaluation of each phase that another phase follows (the loop
    evaluates at the end of every phase, so it is the hand-over's step). The untrained "before" point is no phase."""
    trained = [i for i, p in enumerate(points) if p.phase != "before"]
    return [i for i, nxt in zip(trained, trained[1:]) if points[i].phase != points[nxt].phase]


def plot(curves: list[RunCurve], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, c in enumerate(curves):
        color = f"C{i % 10}"
        xs = ([p.tokens_seen for p in c.points], [p.wall_s / 60 for p in c.points])
        for ax, x in zip(axes, xs):
            ax.plot(x, [p.heldout_tau for p in c.points], "o-", color=color, ms=3, label=c.label)
            for k in hand_overs(c.points):  # Draft-OPD: warm-up -> on-policy
                ax.axvline(x[k], color=color, ls=":", lw=1)
        if c.final_eval is not None:
            fe = c.final_eval
            last = (c.tokens_seen or 0, (c.train_wall_s or 0.0) / 60)
            for ax, x in zip(axes, last):
                ax.plot([x], [fe.tau], "*", color=color, ms=12, mec="black",
                        label=f"{c.label}: final eval tau (gamma {fe.gamma})")
    gammas = sorted({c.heldout_gamma for c in curves if c.heldout_gamma is not None})
    g = f", gamma {'/'.join(map(str, gammas))}" if gammas else ""
    for ax, xl in zip(axes, ("training tokens (loss tokens)", "training wall time (minutes)")):
        ax.set_xlabel(xl)
        ax.set_ylabel(f"{TAU_NAME}{g}")
        ax.set_ylim(bottom=1.0)  # tau >= 1: the axis starts at its floor
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("lines: held-out simulated tau (teacher-forced proxy); stars: final eval tau (speculative decoding); "
                 "dotted: a phase hand-over", fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write(curves: list[RunCurve], out_dir, command: str) -> dict[str, Path]:
    """learning_curves.json, .md and .png in out_dir; returns their paths by name."""
    from specdistill.files import write_text_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in FILES}
    data = {"command": command, "tau": f"{TAU_NAME}: heldout/mean_accept_len of metrics.jsonl",
            "runs": [asdict(c) for c in curves]}
    write_text_atomic(paths["learning_curves.json"], json.dumps(data, indent=1))
    write_text_atomic(paths["learning_curves.md"], markdown(curves, command))
    plot(curves, paths["learning_curves.png"])
    return paths


def load(path) -> list[RunCurve]:
    """The runs of a learning_curves.json, as written."""
    runs = []
    for r in json.loads(Path(path).read_text())["runs"]:
        fe = r.pop("final_eval")
        pts = [HeldoutPoint(**p) for p in r.pop("points")]
        runs.append(RunCurve(**r, points=pts, final_eval=FinalEval(**fe) if fe else None))
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="training run folders (trainer.output_dir)")
    ap.add_argument("--out", required=True, help="folder for learning_curves.{json,md,png}")
    ap.add_argument("--label", action="append", default=[], metavar="RUN=TEXT",
                    help="the legend name of a run (default: run name, draft kind, objective); repeatable")
    a = ap.parse_args(argv)
    command = "python scripts/learning_curves.py " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    labels = {}
    for item in a.label:
        run, sep, text = item.partition("=")
        if not sep or run not in a.runs:
            ap.error(f"--label {item!r}: write RUN=TEXT with RUN one of the run folders given")
        labels[run] = text
    try:
        curves = [read_run(r, labels.get(r)) for r in a.runs]
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for c in curves:
        if not c.points:
            print(f"warning: {c.run} logged no held-out evaluation (trainer.eval_every=0?): it has no line",
                  file=sys.stderr)
    paths = write(curves, a.out, command)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
