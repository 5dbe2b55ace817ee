"""Acceptance along the output, several evaluations on one plot: tau per bucket of output position with its 95%
bootstrap interval over prompts (the evaluator's accept_by_output_position, eval.position_buckets), one line per
labelled run. A run is an evaluator's results.json (or its folder), or one variant of a benchmarks.recipes output as
BENCH_DIR#VARIANT[@FRACTION] scored at --temperature (the same spec scripts/compare_evals.py reads; its curve comes
from the per-prompt samples). Where per-prompt samples exist (an evaluation's outputs.jsonl, a variant's samples), the
table also gives tau in the last bucket over the same prompts' first, a paired bootstrap: the fall along the output
without the change in which prompts are left. Writes <out>.png, <out>.md (the table, with the command) and <out>.json.

    python -m benchmarks.position_curves "T=0=outputs/onpolicy_regime/head_t0/results.json" \
        "T=1=outputs/onpolicy_regime/head_t1/results.json" --out docs/figures/onpolicy_head
    python -m benchmarks.position_curves "OPD=outputs/onpolicy_regime/arms#draft_opd_eagle3" \
        "fresh=outputs/onpolicy_regime/arms#eagle3_fresh" --temperature 1 --out docs/figures/onpolicy_arms_t1
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def parse_run(text: str) -> tuple[str, Path | str]:
    """"label=path/results.json" -> (label, path); the label is everything before the last '=' that precedes a path.
    A BENCH_DIR#VARIANT[@FRACTION] spec stays a string (its folder must hold a benchmarks.recipes results.json)."""
    label, sep, path = text.rpartition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"{text!r}: give each run as LABEL=path/to/results.json "
                                         "or LABEL=BENCH_DIR#VARIANT")
    if "#" in path:
        res = Path(path.partition("#")[0]) / "results.json"
        if not res.is_file():
            raise argparse.ArgumentTypeError(f"{res} does not exist: point LABEL=BENCH_DIR#VARIANT at a "
                                             "benchmarks.recipes output folder")
        return label, path
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"{p} does not exist: point LABEL= at an evaluation's results.json or folder")
    return label, p


def load_curve(path: Path) -> dict:
    """One evaluation's curve: its temperature, overall tau and the per-bucket rows it reported; the last bucket over
    the first on the same prompts from the per-prompt samples beside it (outputs.jsonl), where they are."""
    from specdistill.eval.metrics import last_over_first

    r = json.loads(path.read_text())
    rows = r.get("accept_by_output_position") or []
    if not rows:
        raise ValueError(f"{path} has no accept_by_output_position: evaluate with a specdistill that reports it")
    per_prompt = path.parent / "outputs.jsonl"
    samples = [json.loads(line) for line in per_prompt.read_text().splitlines() if line.strip()] \
        if per_prompt.is_file() else []
    return {"path": str(path), "temperature": r.get("temperature"), "tau": r.get("mean_accept_len"),
            "num_prompts": r.get("num_prompts"), "max_new_tokens": r.get("max_new_tokens"), "buckets": rows,
            "last_over_first": last_over_first(samples)}


def load_bench_curve(spec: str, temperature: float) -> dict:
    """One benchmarks.recipes variant's scoring at `temperature` -> the same curve, its per-bucket tau and 95%
    interval computed from the per-prompt samples (the run paired with itself: its own per-bucket figures)."""
    from specdistill.cli.compare_evals import load_bench_run
    from specdistill.eval.metrics import last_over_first, paired_output_positions

    run = load_bench_run(spec, temperature)
    table = paired_output_positions({spec: run.samples}, spec)
    if not table:
        raise ValueError(f"{spec!r}: its samples carry no output_buckets: score it with a specdistill that records "
                         "acceptance by output position (python -m benchmarks.recipes --append --reeval)")
    buckets = [{"start": b["start"], "end": b["end"], "label": b["label"],
                **{k: b["runs"][spec][k] for k in ("prompts", "tau", "tau_ci95")}} for b in table.values()]
    tokens, forwards = (sum(c[i] for c in run.counts.counts) for i in (0, 1))
    s = run.counts.settings
    return {"path": spec, "temperature": s.get("temperature"), "tau": tokens / max(forwards, 1),
            "num_prompts": len(run.samples), "max_new_tokens": s.get("max_new_tokens"), "buckets": buckets,
            "last_over_first": last_over_first(run.samples)}


def markdown(curves: dict[str, dict], command: str) -> str:
    labels = sorted({b["label"] for c in curves.values() for b in c["buckets"]},
                    key=lambda s: int(s.split("-")[0].rstrip("+")))
    head = "| run | overall tau | " + " | ".join(f"tau {x} [95% CI] (prompts)" for x in labels) + \
        " | last / first bucket, same prompts [paired 95% CI] (prompts) |"
    lines = [f"Command: `{command}`", "", head, "|" + "---|" * (len(labels) + 3)]
    for name, c in curves.items():
        by = {b["label"]: b for b in c["buckets"]}
        cells = []
        for x in labels:
            b = by.get(x)
            ci = b.get("tau_ci95") if b else None
            cells.append("-" if b is None else f"{b['tau']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
                         + f" ({b['prompts']})")
        d = c.get("last_over_first")
        if d and d["tau_ratio"] is not None:
            ci = d["tau_ratio_ci95"]
            cells.append(f"{d['tau_ratio']:.3f}x" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
                         + f" ({d['last']} / {d['first']}, {d['prompts']})")
        else:
            cells.append("-")
        lines.append(f"| {name} | {c['tau']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, c in curves.items():
        xs, ys, lo, hi = [], [], [], []
        for b in c["buckets"]:
            end = b["end"] if b["end"] is not None else b["start"] * 2
            xs.append((b["start"] + end - 1) / 2)
            ys.append(b["tau"])
            ci = b.get("tau_ci95") or [b["tau"], b["tau"]]
            lo.append(b["tau"] - ci[0])
            hi.append(ci[1] - b["tau"])
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
    ax.set_xlabel("output position where a round starts (bucket middle, tokens)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("acceptance along the output, 95% bootstrap over prompts")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=parse_run,
                    help="LABEL=path/to/results.json (or its folder), or LABEL=BENCH_DIR#VARIANT[@FRACTION]")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="which scoring of a BENCH_DIR#VARIANT run (T=0 or T=1); an evaluator's results.json holds one")
    ap.add_argument("--out", required=True, help="output stem: writes STEM.png, STEM.md, STEM.json")
    args = ap.parse_args(argv)
    curves = {label: load_bench_curve(path, args.temperature) if isinstance(path, str) else load_curve(path)
              for label, path in args.runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.position_curves " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    out.with_suffix(".json").write_text(json.dumps({"command": command, "curves": curves}, indent=1))
    out.with_suffix(".md").write_text(markdown(curves, command))
    plot(curves, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())
    return curves


if __name__ == "__main__":
    main()
