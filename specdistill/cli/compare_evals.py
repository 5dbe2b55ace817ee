"""`specdistill-compare` (scripts/compare_evals.py): evaluator runs of several drafts on the same prompts, compared.
tau with a bootstrap interval over prompts, and each run's tau against a baseline run as a PAIRED bootstrap interval
(the same resampled prompts for both), overall and per prompt category (specdistill.eval.compare).

  python scripts/compare_evals.py outputs/eval_kd outputs/eval_opd --baseline outputs/eval_kd --out outputs/cmp

Each folder is a scripts/evaluate.py output (results.json + outputs.jsonl with per-prompt new_tokens,
target_forwards, category and per-position counts), or one scoring inside a benchmarks.recipes output, written
BENCH_DIR#VARIANT[@FRACTION]: the variant's scoring at that budget point (default its last) at --temperature, read
from BENCH_DIR/results.json (the bench keeps every scoring's per-prompt counts there), so arms of different benchmark
runs can be paired; or one checkpoint of a scripts/learning_curve.py output, written CURVE_DIR[@STEP] (default its
last point):

  python scripts/compare_evals.py outputs/bench_a#eagle3_regen@0.5 outputs/bench_b#draft_opd_eagle3_no_replay \
      --temperature 0 --out outputs/cmp

Runs made under different prompt sets, max_new_tokens, temperatures, gamma or draft policies are refused unless
--allow-mismatch. When every run's per-prompt samples carry acceptance by output position (output_buckets, written by
the evaluator per eval.position_buckets), each bucket's tau and accepted/proposed drafts are compared with the
baseline's too, as paired ratios over the prompts both reached the bucket (by_output_position). Writes
<out>/compare.json and <out>/compare.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from specdistill.eval.compare import COMPARABLE, RunCounts, compare, markdown
from specdistill.eval.metrics import paired_output_positions


@dataclass
class LoadedRun:
    """One run: its per-prompt counts for compare() and its per-prompt samples (acceptance by output position)."""
    counts: RunCounts
    samples: list[dict]


def _loaded(name: str, settings: dict, samples: list[dict], draft=None) -> LoadedRun:
    return LoadedRun(RunCounts.from_samples(name, settings, samples, draft=draft), samples)


def load_run(folder, temperature: float = 0.0) -> LoadedRun:
    """An evaluator output folder, or BENCH_DIR#VARIANT[@FRACTION] -> its per-prompt counts and samples and the
    settings that make runs comparable."""
    if "#" in str(folder):
        return load_bench_run(str(folder), temperature)
    if (Path(curve_spec(str(folder))[0]) / "curve.json").exists():
        return load_curve_run(str(folder))
    folder = Path(folder)
    res, outs = folder / "results.json", folder / "outputs.jsonl"
    for f in (res, outs):
        if not f.exists():
            raise FileNotFoundError(f"{f} is missing: pass folders written by scripts/evaluate.py")
    rows = [json.loads(x) for x in outs.read_text().splitlines() if x.strip()]
    r = json.loads(res.read_text())
    cfg = r.get("config", {})
    # results.json's own fields (what ran) first; its eval config's keys where a results.json lacks a field
    settings = {k: r.get(k, cfg.get(k)) for k in COMPARABLE}
    settings["num_prompts"] = len(rows)
    return _loaded(str(folder), settings, rows, draft=r.get("draft_path", cfg.get("draft_path")))


def curve_spec(spec: str) -> tuple[str, str]:
    """CURVE_DIR[@STEP] -> (CURVE_DIR, STEP or "")."""
    folder, _, step = spec.rpartition("@") if "@" in spec else (spec, "", "")
    return folder, step


def load_curve_run(spec: str) -> LoadedRun:
    """CURVE_DIR[@STEP]: one checkpoint's scoring in a scripts/learning_curve.py output (default: its last point)."""
    folder, step = curve_spec(spec)
    data = json.loads((Path(folder) / "curve.json").read_text())
    points = data.get("points") or []
    if step:
        if not step.isdigit():
            raise ValueError(f"{spec!r}: the checkpoint step {step!r} is not a number (e.g. @576)")
        points = [p for p in points if int(p["step"]) == int(step)]
        if not points:
            raise ValueError(f"{spec!r}: {folder}/curve.json scored steps {[p['step'] for p in data['points']]}, "
                             f"not {step}")
    if not points:
        raise ValueError(f"{spec!r}: {folder}/curve.json has no scored checkpoint")
    point = points[-1]
    if not point.get("samples"):
        raise ValueError(f"{spec!r}: its curve.json holds no per-prompt counts (no samples at its points): "
                         "score it again with scripts/learning_curve.py")
    settings = {k: data.get(k) for k in COMPARABLE}
    settings["draft_policy"] = settings.get("draft_policy") or "greedy"  # the curve's drafts are greedy
    return _loaded(str(Path(spec)), settings, point["samples"], draft=f"{data.get('label')} step {point['step']}")


def load_bench_run(spec: str, temperature: float) -> LoadedRun:
    """BENCH_DIR#VARIANT[@FRACTION]: one scoring of a benchmarks.recipes run (its results.json), at `temperature`."""
    bench_dir, _, rest = spec.partition("#")
    variant, _, frac = rest.partition("@")
    res = Path(bench_dir) / "results.json"
    if not res.exists():
        raise FileNotFoundError(f"{res} is missing: {spec!r} names a variant of a benchmarks.recipes output folder "
                                "(BENCH_DIR#VARIANT[@FRACTION])")
    variants = json.loads(res.read_text())["variants"]
    if variant not in variants:
        raise ValueError(f"{spec!r}: {res} holds no variant {variant!r}; it has {sorted(variants)}")
    r = variants[variant]
    points = r.get("points") or [{"fraction": 1.0, "eval": r["eval"]}]  # an untrained baseline: its one scoring
    if frac:
        try:
            want = float(frac)
        except ValueError:
            raise ValueError(f"{spec!r}: the budget fraction {frac!r} is not a number (e.g. @0.5)") from None
        match = [p for p in points if abs(float(p["fraction"]) - want) < 1e-6]
        if not match:
            raise ValueError(f"{spec!r}: {variant} was scored at fractions {[p['fraction'] for p in points]}, "
                             f"not {want:g}")
        point = match[0]
    else:
        point = points[-1]
    key = f"T={temperature:g}"
    if key not in point["eval"]:
        raise ValueError(f"{spec!r} was scored at {sorted(point['eval'])}, not {key}: pass --temperature")
    e = point["eval"][key]
    if not e.get("samples"):
        raise ValueError(f"{spec!r}: its scoring at {key} kept no per-prompt samples (an older bench): re-score it "
                         "with python -m benchmarks.recipes --append --reeval --only " + variant)
    return _loaded(spec, e["eval_settings"], e["samples"], draft=f"{variant} at {point['fraction']:g} of its budget "
                   f"({point.get('steps', 0)} steps)")


def _ci(ci) -> str:
    return "" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]"


def _ratio(x, ci) -> str:
    return "-" if x is None else f"{x:.3f}x{_ci(ci)}"


def output_position_markdown(table: dict[str, dict], baseline: str) -> list[str]:
    """Per bucket of output position: each run's tau and accepted/proposed drafts and their paired ratios to the
    baseline's (empty when the runs carry no output buckets)."""
    if not table:
        return []
    lines = ["", "Per bucket of output position (a round belongs to the bucket where it starts): tau and accepted / "
                 "proposed drafts over the prompts both runs reached it, / baseline [paired 95% CI]", "",
             "| output tokens | run | prompts | tau | / baseline | accept rate | / baseline |",
             "|---|---|---|---|---|---|---|"]
    for bucket in table.values():
        for run, e in bucket["runs"].items():
            same = run == baseline
            lines.append(f"| {bucket['label']} | {run} | {e['prompts']} | {e['tau']:.3f}{_ci(e['tau_ci95'])} | "
                         f"{'-' if same else _ratio(e['tau_ratio'], e['tau_ratio_ci95'])} | "
                         f"{e['accept_rate']:.3f}{_ci(e['accept_rate_ci95'])} | "
                         f"{'-' if same else _ratio(e['accept_rate_ratio'], e['accept_rate_ratio_ci95'])} |")
    return lines


def main(argv=None) -> dict:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("runs", nargs="+", help="scripts/evaluate.py output folders, or BENCH_DIR#VARIANT[@FRACTION]")
    a.add_argument("--temperature", type=float, default=0.0,
                   help="which scoring of a bench variant (T=0 or T=1); evaluator folders hold one")
    a.add_argument("--baseline", default=None, help="the run the others are divided by (default: the first)")
    a.add_argument("--out", default="outputs/compare_evals")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--allow-mismatch", action="store_true",
                   help="compare runs made under different prompts / max_new_tokens / temperature / gamma / "
                        "draft_policy anyway (the report says which differ)")
    args = a.parse_args(argv)
    base_dir = args.baseline or args.runs[0]
    name = lambda f: f if "#" in f else str(Path(f))  # noqa: E731
    loaded = [load_run(f, args.temperature) for f in dict.fromkeys(list(args.runs) + [base_dir])]
    runs = [x.counts for x in loaded]
    result = compare(runs, name(base_dir), args.seed, args.allow_mismatch)
    result["by_output_position"] = paired_output_positions({x.counts.name: x.samples for x in loaded},
                                                           name(base_dir), args.seed)
    base = next(r for r in runs if r.name == name(base_dir))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"baseline": base_dir, "settings": base.settings, "drafts": {r.name: r.draft for r in runs},
            "seed": args.seed, "argv": sys.argv[1:] if argv is None else list(argv)}
    (out / "compare.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    s = base.settings
    lines = markdown(result, f"# tau on {s['num_prompts']} prompts of {s['prompts']}, {s['max_new_tokens']} new "
                             f"tokens, temperature {s['temperature']}, gamma {s['gamma']}, draft policy "
                             f"{s['draft_policy']}")
    lines += output_position_markdown(result["by_output_position"], result["baseline"])
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
