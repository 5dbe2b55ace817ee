"""Evaluator runs of several drafts on the same prompts, compared: tau with a bootstrap interval over prompts, and each
run's tau against a baseline run's as a PAIRED bootstrap ratio (the same resampled prompts for both), overall and
within each prompt category (MT-bench: writing, roleplay, reasoning, math, coding, extraction, stem, humanities).

Knows nothing of files or models: a run arrives as RunCounts, its per-prompt counts (cli/compare_evals.py reads them
from evaluator output folders, cli/bench.py from its own evaluations). A comparison is refused when the runs were made
under settings that change tau by themselves (COMPARABLE), unless the caller allows it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specdistill.eval.stats import ratio_interval, tau_interval

# Settings that must agree for a paired comparison of tau to mean anything: the prompt set, the output length, the
# sampling temperature, the draft length and how drafts are proposed at T > 0 (greedy / sample).
COMPARABLE = ("prompts", "num_prompts", "max_new_tokens", "temperature", "gamma", "draft_policy")


@dataclass
class RunCounts:
    """One evaluator run, per prompt, sorted by prompt index."""
    name: str
    settings: dict                      # COMPARABLE key -> value
    prompts: list[int]                  # (N,) prompt index in the prompt set
    categories: list[Optional[str]]     # (N,)
    counts: list[list[int]]             # (N, 2) [new tokens, target forwards]
    reached: list[list[int]]            # (N, G) drafts that reached draft position k (prefix accepted)
    accepted: list[list[int]]           # (N, G) ... and were accepted there
    draft: Optional[str] = None         # what was evaluated (a path), for the report

    @classmethod
    def from_samples(cls, name: str, settings: dict, samples: list[dict], draft: Optional[str] = None) -> "RunCounts":
        """From the evaluator's per-prompt samples (EvalResult.samples, outputs.jsonl rows)."""
        if any("target_forwards" not in s for s in samples):
            raise ValueError(f"{name}: its per-prompt samples have no target_forwards (written by an older "
                             "evaluator): evaluate again")
        rows = sorted(samples, key=lambda s: s["prompt"])
        return cls(name, {k: settings.get(k) for k in COMPARABLE}, [s["prompt"] for s in rows],
                   [s.get("category") for s in rows], [[s["new_tokens"], s["target_forwards"]] for s in rows],
                   [s.get("reached_per_pos", []) for s in rows], [s.get("accepted_per_pos", []) for s in rows], draft)


def differences(run: RunCounts, base: RunCounts) -> list[str]:
    """What makes `run` not comparable with `base`, one phrase each (empty: comparable)."""
    out = [f"{k} {run.settings.get(k)!r} vs {base.settings.get(k)!r}" for k in COMPARABLE
           if run.settings.get(k) != base.settings.get(k)]
    if run.prompts != base.prompts:
        out.append(f"prompt indices ({len(run.prompts)} prompts vs {len(base.prompts)})")
    return out


def check_comparable(runs: list[RunCounts], base: RunCounts, allow_mismatch: bool = False) -> dict[str, list[str]]:
    """{run name: differences from the baseline}; raises ValueError naming them unless allow_mismatch."""
    diffs = {r.name: d for r in runs if (d := differences(r, base))}
    if diffs and not allow_mismatch:
        said = "; ".join(f"{n}: {', '.join(d)}" for n, d in diffs.items())
        raise ValueError(f"runs made under different settings cannot be compared with the baseline {base.name} "
                         f"({said}). Evaluate them again with the same eval.prompts, num_prompts, max_new_tokens, "
                         "temperature, gamma and draft_policy, or pass --allow-mismatch to compare anyway (prompts "
                         "are then paired by index where both runs have them)")
    return diffs


def _rate(accepted: list[list[int]], reached: list[list[int]]) -> list[float]:
    """a_k = sum accepted / sum reached per draft position, over the given prompts."""
    if not accepted or not accepted[0]:
        return []
    G = max(len(a) for a in accepted)
    acc = [sum(a[k] for a in accepted if k < len(a)) for k in range(G)]
    rea = [sum(r[k] for r in reached if k < len(r)) for k in range(G)]
    return [a / max(r, 1) for a, r in zip(acc, rea)]


def _entry(run: RunCounts, base: RunCounts, rows: list[int], base_rows: list[int], seed: int) -> dict:
    """tau, its interval, a_k and the paired ratio to the baseline over the given rows of each run (row i of `rows`
    and of `base_rows` are the same prompt)."""
    counts = [run.counts[i] for i in rows]                 # (n, 2)
    base_counts = [base.counts[i] for i in base_rows]      # (n, 2), the same prompts
    tau = sum(c[0] for c in counts) / max(sum(c[1] for c in counts), 1)
    base_tau = sum(c[0] for c in base_counts) / max(sum(c[1] for c in base_counts), 1)
    return {"prompts": len(rows), "tau": tau, "tau_ci95": tau_interval(counts, seed),
            "accept_rate_per_pos": _rate([run.accepted[i] for i in rows], [run.reached[i] for i in rows]),
            "ratio_to_baseline": tau / base_tau if base_tau > 0 else None,
            "ratio_ci95": ratio_interval(counts, base_counts, seed)}


def _paired_rows(run: RunCounts, base: RunCounts, category: Optional[str] = None) -> tuple[list[int], list[int]]:
    """Row indices of the prompts both runs have (in the category, if given), in prompt order, for each run."""
    where = {p: i for i, p in enumerate(base.prompts)}
    pairs = [(i, where[p]) for i, p in enumerate(run.prompts) if p in where
             and (category is None or run.categories[i] == category)]
    return [a for a, _ in pairs], [b for _, b in pairs]


def compare(runs: list[RunCounts], baseline: str, seed: int = 0, allow_mismatch: bool = False) -> dict:
    """{"baseline", "differences", "overall": {run: entry}, "by_category": {category: {run: entry}}}; an entry holds
    prompts, tau, tau_ci95, accept_rate_per_pos, ratio_to_baseline and its paired ratio_ci95."""
    base = next((r for r in runs if r.name == baseline), None)
    if base is None:
        raise ValueError(f"the baseline {baseline!r} is not among the runs {[r.name for r in runs]}")
    diffs = check_comparable(runs, base, allow_mismatch)
    overall = {r.name: _entry(r, base, *_paired_rows(r, base), seed) for r in runs}
    cats = list(dict.fromkeys(c for c in base.categories if c is not None))
    by_cat = {c: {r.name: _entry(r, base, *_paired_rows(r, base, c), seed) for r in runs} for c in cats}
    return {"baseline": baseline, "differences": diffs, "overall": overall, "by_category": by_cat}


def _ci(ci) -> str:
    return "" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]"


def markdown(result: dict, title: str = "") -> list[str]:
    """Markdown lines: the overall table (tau, a_k, ratio to the baseline) and tau / baseline per category."""
    names = list(result["overall"])
    lines = ([title, ""] if title else []) + [
        "| run | tau [95% CI] | a_k per draft position | / baseline [paired 95% CI] |", "|---|---|---|---|"]
    for n, e in result["overall"].items():
        ratio = "-" if e["ratio_to_baseline"] is None else f"{e['ratio_to_baseline']:.3f}x{_ci(e['ratio_ci95'])}"
        lines.append(f"| {n} | {e['tau']:.3f}{_ci(e['tau_ci95'])} | "
                     f"{', '.join(f'{a:.2f}' for a in e['accept_rate_per_pos'])} | {ratio} |")
    if result["by_category"]:
        lines += ["", "Per category: tau (a_1) and tau / baseline [paired 95% CI]", "",
                  "| category | prompts | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for cat, row in result["by_category"].items():
            cells = []
            for n in names:
                e = row[n]
                a1 = f" (a_1 {e['accept_rate_per_pos'][0]:.2f})" if e["accept_rate_per_pos"] else ""
                ratio = "" if e["ratio_to_baseline"] is None or n == result["baseline"] else \
                    f", {e['ratio_to_baseline']:.3f}x{_ci(e['ratio_ci95'])}"
                cells.append(f"{e['tau']:.3f}{a1}{ratio}")
            lines.append(f"| {cat} | {row[result['baseline']]['prompts']} | " + " | ".join(cells) + " |")
    if result["differences"]:
        lines += ["", "**Settings differ from the baseline's** (compared anyway, --allow-mismatch): " + "; ".join(
            f"{n}: {', '.join(d)}" for n, d in result["differences"].items())]
    lines += ["", f"Baseline: {result['baseline']}. Bootstrap over prompts (2000 resamples)."]
    return lines
