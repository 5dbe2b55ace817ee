"""`specdistill-compare` (scripts/compare_evals.py): evaluator runs of several drafts on the same prompts, compared.
tau with a bootstrap interval over prompts, and each run's tau against a baseline run as a PAIRED bootstrap interval
(the same resampled prompts for both), overall and per prompt category (specdistill.eval.compare).

  python scripts/compare_evals.py outputs/eval_kd outputs/eval_opd --baseline outputs/eval_kd --out outputs/cmp

Each folder is a scripts/evaluate.py output (results.json + outputs.jsonl with per-prompt new_tokens,
target_forwards, category and per-position counts). Runs made under different prompt sets, max_new_tokens,
temperatures, gamma or draft policies are refused unless --allow-mismatch. Writes <out>/compare.json and
<out>/compare.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdistill.eval.compare import COMPARABLE, RunCounts, compare, markdown


def load_run(folder: Path) -> RunCounts:
    """An evaluator output folder -> its per-prompt counts and the settings that make runs comparable."""
    res, outs = folder / "results.json", folder / "outputs.jsonl"
    for f in (res, outs):
        if not f.exists():
            raise FileNotFoundError(f"{f} is missing: pass folders written by scripts/evaluate.py")
    rows = [json.loads(x) for x in outs.read_text().splitlines() if x.strip()]
    r = json.loads(res.read_text())
    cfg = r.get("config", {})
    # results.json's own fields (what ran) first; eval config keys for runs written before a field existed
    settings = {k: r.get(k, cfg.get(k)) for k in COMPARABLE}
    settings["num_prompts"] = len(rows)
    return RunCounts.from_samples(str(folder), settings, rows, draft=r.get("draft_path", cfg.get("draft_path")))


def main(argv=None) -> dict:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("runs", nargs="+", help="scripts/evaluate.py output folders")
    a.add_argument("--baseline", default=None, help="the run the others are divided by (default: the first)")
    a.add_argument("--out", default="outputs/compare_evals")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--allow-mismatch", action="store_true",
                   help="compare runs made under different prompts / max_new_tokens / temperature / gamma / "
                        "draft_policy anyway (the report says which differ)")
    args = a.parse_args(argv)
    base_dir = args.baseline or args.runs[0]
    runs = [load_run(Path(f)) for f in dict.fromkeys(list(args.runs) + [base_dir])]
    result = compare(runs, str(Path(base_dir)), args.seed, args.allow_mismatch)
    base = next(r for r in runs if r.name == str(Path(base_dir)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"baseline": base_dir, "settings": base.settings, "drafts": {r.name: r.draft for r in runs},
            "seed": args.seed, "argv": sys.argv[1:] if argv is None else list(argv)}
    (out / "compare.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    s = base.settings
    lines = markdown(result, f"# tau on {s['num_prompts']} prompts of {s['prompts']}, {s['max_new_tokens']} new "
                             f"tokens, temperature {s['temperature']}, gamma {s['gamma']}, draft policy "
                             f"{s['draft_policy']}")
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
