"""Compare evaluator runs of several drafts on the same prompts: tau with a bootstrap interval over prompts, and each
run's tau against a baseline run as a PAIRED bootstrap interval (the same resampled prompts for both).

  python scripts/compare_evals.py outputs/eval_kd outputs/eval_opd --baseline outputs/eval_kd --out outputs/cmp

Each folder is a scripts/evaluate.py output (results.json + outputs.jsonl with per-prompt new_tokens and
target_forwards). Writes <out>/compare.json and <out>/compare.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_run(folder: Path) -> dict:
    res, outs = folder / "results.json", folder / "outputs.jsonl"
    for f in (res, outs):
        if not f.exists():
            raise FileNotFoundError(f"{f} is missing: pass folders written by scripts/evaluate.py")
    rows = [json.loads(x) for x in outs.read_text().splitlines() if x.strip()]
    if any("target_forwards" not in r for r in rows):
        raise ValueError(f"{outs} has no per-prompt target_forwards (written by an older evaluator): evaluate again")
    rows.sort(key=lambda r: r["prompt"])
    r = json.loads(res.read_text())
    cfg = r.get("config", {})
    return {"folder": str(folder), "tau": r["mean_accept_len"], "prompts": [x["prompt"] for x in rows],
            "counts": [[x["new_tokens"], x["target_forwards"]] for x in rows],
            "temperature": cfg.get("temperature"), "gamma": cfg.get("gamma"), "draft": cfg.get("draft_path")}


def main(argv=None) -> dict:
    from specdistill.eval.stats import ratio_interval, tau_interval

    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("runs", nargs="+", help="scripts/evaluate.py output folders")
    a.add_argument("--baseline", default=None, help="the run the others are divided by (default: the first)")
    a.add_argument("--out", default="outputs/compare_evals")
    a.add_argument("--seed", type=int, default=0)
    args = a.parse_args(argv)
    base_dir = args.baseline or args.runs[0]
    runs = {f: load_run(Path(f)) for f in dict.fromkeys(list(args.runs) + [base_dir])}
    base = runs[base_dir]
    for f, r in runs.items():
        if r["prompts"] != base["prompts"] or (r["temperature"], r["gamma"]) != (base["temperature"], base["gamma"]):
            raise ValueError(f"{f} did not run the baseline's prompts / temperature / gamma: a paired comparison "
                             "needs the same eval.prompts, num_prompts, temperature and gamma")
    table = {}
    for f, r in runs.items():
        table[f] = {"draft": r["draft"], "tau": r["tau"], "tau_ci95": tau_interval(r["counts"], args.seed),
                    "ratio_to_baseline": r["tau"] / base["tau"],
                    "ratio_ci95": ratio_interval(r["counts"], base["counts"], args.seed)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"baseline": base_dir, "prompts": len(base["prompts"]), "temperature": base["temperature"],
            "gamma": base["gamma"], "argv": sys.argv[1:] if argv is None else argv}
    (out / "compare.json").write_text(json.dumps({"meta": meta, "runs": table}, indent=1))
    fmt = lambda ci: "" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]"  # noqa: E731
    lines = [f"# tau on {meta['prompts']} prompts, temperature {meta['temperature']}, gamma {meta['gamma']}", "",
             "| run | draft | tau [95% CI] | / baseline [paired 95% CI] |", "|---|---|---|---|"]
    for f, t in table.items():
        lines.append(f"| {f} | {t['draft']} | {t['tau']:.3f}{fmt(t['tau_ci95'])} | "
                     f"{t['ratio_to_baseline']:.3f}x{fmt(t['ratio_ci95'])} |")
    lines += ["", f"Baseline: {base_dir}. Bootstrap over prompts (2000 resamples, seed {args.seed})."]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return table


if __name__ == "__main__":
    main()
