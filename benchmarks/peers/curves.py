"""Learning curves across peers-benchmark runs: every arm's scored head from several runs of `benchmarks.peers.run`
(e.g. one stopped at equal wall time, one at a full epoch) as points of tau against loss tokens and against training
wall time, one plot.

    python -m benchmarks.peers.curves outputs/peers outputs/peers_eqtok --out outputs/peers_curves

Each run contributes, per arm, the head it scored at the setting (default: each run's primary one, which must be the
same in all): its loss tokens, its training seconds and its tau with the bootstrap interval of the run's paired
table. The runs must have scored on the same prompts, tokens, gamma, temperature and batch size (read from each
evaluation's command), or their points would not share an axis; a run that differs is refused by name. A point is
a measured head, never interpolated; two runs that scored the same head (a reused arm) give one point. Within an arm
the runs share the seed, the data order and the schedule's length, so a run cut by a deadline stopped on the way to
the head of the run that finished (up to the run-to-run spread the benchmark reports).

Writes curves.json, curves.md (with the command) and curves.png in --out.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

# the evaluator settings every merged run must share, read from each evaluation's command
SHARED_EVAL_KEYS = ("eval.num_prompts", "eval.max_new_tokens", "eval.gamma", "eval.temperature", "eval.batch_size")


@dataclass(frozen=True)
class CurvePoint:
    """One scored head of one arm: how much it trained and its tau."""
    run: str
    loss_tokens: int
    train_s: float
    tau: float
    tau_lo: Optional[float]
    tau_hi: Optional[float]


def eval_settings(command: str) -> dict:
    """The SHARED_EVAL_KEYS values of one scripts/evaluate.py command line."""
    found = dict(re.findall(r"(eval\.[a-z_]+)=(\S+)", command))
    return {k: found.get(k) for k in SHARED_EVAL_KEYS}


def load_run(folder: Path) -> dict:
    f = Path(folder) / "results.json"
    if not f.exists():
        raise SystemExit(f"{folder}: no results.json; pass the --out folder of a finished benchmarks.peers.run")
    return json.loads(f.read_text())


def run_points(name: str, results: dict, setting: str) -> tuple[dict, dict[str, CurvePoint]]:
    """(the evaluator settings of this run at `setting`, {arm: its point}) for every arm scored there."""
    if setting not in results.get("settings", []):
        raise SystemExit(f"run {name} did not score {setting} (it scored {results.get('settings')}); pass --setting "
                         "one every run scored")
    overall = (((results.get("paired") or {}).get(setting) or {}).get("overall")) or {}
    points, settings = {}, None
    for arm, rec in results["arms"].items():
        e = (rec.get("evals") or {}).get(setting) or {}
        if "tau" not in e or not rec.get("loss_tokens") or not rec.get("wall_s"):
            continue
        mine = eval_settings(e["command"])
        if settings is not None and mine != settings:
            raise SystemExit(f"run {name}: arm {arm} was scored with {mine}, another arm with {settings}")
        settings = mine
        ci = (overall.get(arm) or {}).get("tau_ci95") or [None, None]
        points[arm] = CurvePoint(run=name, loss_tokens=int(rec["loss_tokens"]), train_s=float(rec["wall_s"]),
                                 tau=float(e["tau"]), tau_lo=ci[0], tau_hi=ci[1])
    return settings or {}, points


def merge(runs: dict[str, dict], setting: Optional[str] = None) -> tuple[str, dict[str, list[CurvePoint]]]:
    """(the setting, {arm: its points sorted by loss tokens}) over runs {name: results.json}; refuses runs scored
    with other evaluator settings (SHARED_EVAL_KEYS)."""
    if not runs:
        raise SystemExit("no runs given")
    firsts = {n: r["settings"][0] for n, r in runs.items()}
    if setting is None:
        if len(set(firsts.values())) > 1:
            raise SystemExit(f"the runs' primary settings differ ({firsts}); pass --setting")
        setting = next(iter(firsts.values()))
    curves: dict[str, list[CurvePoint]] = {}
    reference = None
    for name, results in runs.items():
        settings, points = run_points(name, results, setting)
        if reference is None:
            reference = (name, settings)
        elif settings and settings != reference[1]:
            differ = {k: (reference[1][k], settings[k]) for k in SHARED_EVAL_KEYS if reference[1][k] != settings[k]}
            raise SystemExit(f"run {name} scored with other evaluator settings than run {reference[0]} "
                             f"({reference[0]} -> {name}: {differ}); score both alike to draw them on one curve")
        for arm, p in points.items():
            seen = curves.setdefault(arm, [])
            if not any((q.loss_tokens, q.train_s, q.tau) == (p.loss_tokens, p.train_s, p.tau) for q in seen):
                seen.append(p)
    return setting, {arm: sorted(ps, key=lambda p: (p.loss_tokens, p.train_s)) for arm, ps in curves.items()}


def markdown(command: str, setting: str, curves: dict[str, list[CurvePoint]]) -> list[str]:
    lines = [f"# Learning curves across peers runs ({setting})", "", f"Command: `{command}`", "",
             "Every point is one head scored by specdistill's evaluator (tau with the bootstrap 95% interval over "
             "prompts from its run's paired table); the runs share the evaluator settings.", "",
             "| arm | run | loss tokens | training s | tau [95% CI] |", "|---|---|---|---|---|"]
    for arm, ps in curves.items():
        for p in ps:
            ci = f" [{p.tau_lo:.3f}, {p.tau_hi:.3f}]" if p.tau_lo is not None else ""
            lines.append(f"| {arm} | {p.run} | {p.loss_tokens:,} | {p.train_s:.0f} | {p.tau:.3f}{ci} |")
    return lines


def plot(curves: dict[str, list[CurvePoint]], setting: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, ps in curves.items():
        err = None
        if all(p.tau_lo is not None for p in ps):
            err = [[p.tau - p.tau_lo for p in ps], [p.tau_hi - p.tau for p in ps]]
        for ax, x in zip(axes, ([p.loss_tokens for p in ps], [p.train_s for p in ps])):
            ax.errorbar(x, [p.tau for p in ps], yerr=err, marker="o", capsize=3, label=arm)
    axes[0].set(xlabel="loss tokens trained", ylabel=f"tau ({setting})", title="tau against training tokens")
    axes[1].set(xlabel="training wall time (s)", ylabel=f"tau ({setting})", title="tau against wall time")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="--out folders of benchmarks.peers.run")
    ap.add_argument("--setting", default=None, help="the scored setting, e.g. T0-g4 (default: the runs' primary)")
    ap.add_argument("--out", type=Path, required=True, help="folder for curves.json, curves.md and curves.png")
    a = ap.parse_args(argv)
    names = [str(f) for f in a.runs]
    if len(set(names)) != len(names):
        ap.error("a run folder is given twice")
    runs = {n: load_run(f) for n, f in zip(names, a.runs)}
    setting, curves = merge(runs, a.setting)
    command = shlex.join([sys.executable, "-m", "benchmarks.peers.curves", *(argv if argv is not None
                                                                            else sys.argv[1:])])
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "curves.json").write_text(json.dumps({"command": command, "setting": setting, "runs": names,
                                                   "curves": {k: [asdict(p) for p in v] for k, v in curves.items()}},
                                                  indent=1))
    (a.out / "curves.md").write_text("\n".join(markdown(command, setting, curves)) + "\n")
    plot(curves, setting, a.out / "curves.png")
    print((a.out / "curves.md").read_text())


if __name__ == "__main__":
    main()
