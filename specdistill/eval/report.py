"""Evaluator reports: results.json (every number), results.md (a table to read), outputs.jsonl and PNG plots."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from specdistill.eval.evaluator import EvalResult
from specdistill.output_positions import bucket_label
from specdistill.eval.tree_cost import cost_model_markdown

REQUIRED_KEYS = ("mean_accept_len", "accept_rate_per_pos", "tokens_per_s", "target_only_tokens_per_s", "speedup",
                 "gamma", "temperature", "draft_policy", "num_prompts", "new_tokens")
PLOTS = ("accept_rate_per_pos.png", "accept_len_hist.png", "speedup_vs_batch_size.png", "accept_by_output_position.png")


def _clean(x):
    """JSON has no NaN/inf: write null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_report(result: EvalResult, out_dir, plots: bool = True, extra: Optional[dict] = None) -> dict[str, Path]:
    """Write results.json, results.md, outputs.jsonl and (plots=True) the PNGs; return their paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = _clean(result.to_dict()) | (extra or {})
    paths = {"results.json": out / "results.json", "results.md": out / "results.md",
             "outputs.jsonl": out / "outputs.jsonl"}
    paths["results.json"].write_text(json.dumps(data, indent=1))
    paths["results.md"].write_text(markdown(result))
    with paths["outputs.jsonl"].open("w") as f:
        for s in result.samples:
            f.write(json.dumps(s) + "\n")
    if plots:
        paths.update(write_plots(result, out))
    return paths


def _f(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown(r: EvalResult) -> str:
    gamma = f"{r.gamma} (dynamic, mean {r.mean_gamma:.2f})" if r.dynamic_gamma else str(r.gamma)
    rows = [
        ("drafter", r.drafter), ("prompts", f"{r.prompts} ({r.num_prompts})"), ("gamma", gamma),
        ("temperature / top_p", f"{r.temperature} / {r.top_p}"),
        ("draft policy (T > 0)", r.draft_policy if r.temperature > 0 else f"{r.draft_policy} (T=0: greedy)"),
        ("batch size", r.batch_size),
        ("max new tokens", r.max_new_tokens), ("generated tokens (spec / target-only)",
                                               f"{r.new_tokens} / {r.target_only_new_tokens}"),
        ("**mean accept length tau** (tokens per target forward)", _f(r.mean_accept_len)),
        ("alpha (acceptance given an accepted prefix)", _f(r.alpha)),
        ("accept rate per position a_k", ", ".join(_f(a) for a in r.accept_rate_per_pos)),
        ("**tokens/s speculative**", _f(r.tokens_per_s, 2)),
        ("**tokens/s target-only**", _f(r.target_only_tokens_per_s, 2)),
        ("**speedup** (wall clock, prefill included)", _f(r.speedup)),
        ("decode-only speedup", _f(r.decode_speedup)),
        ("per-token latency p50 / p95 / p99 ms (spec)",
         " / ".join(_f(r.latency_ms[q], 1) for q in ("p50", "p95", "p99"))),
        ("per-token latency p50 / p95 / p99 ms (target-only)",
         " / ".join(_f(r.target_only_latency_ms[q], 1) for q in ("p50", "p95", "p99"))),
        ("round cost / target step (from rollouts)", _f(r.round_cost_ratio)),
    ]
    if r.cost is not None:
        rows += [("cost c = draft token / target forward (steady state)", _f(r.cost.c)),
                 ("first draft round after the prefill, ms (apart from c)", _f(r.cost.draft_prefill_ms, 1)),
                 ("v = verify forward (gamma+1 tokens) / target forward", _f(r.cost.v)),
                 ("predicted tau from alpha (i.i.d.)", _f(r.predicted_tau_from_alpha)),
                 ("predicted speedup (Leviathan, from alpha and c)", _f(r.predicted_speedup)),
                 ("predicted speedup (measured tau, c and v)", _f(r.predicted_speedup_measured_tau))]
    rows.append(("greedy mismatches vs target-only (should be 0)",
                 "- (sampling)" if r.greedy_mismatches is None else r.greedy_mismatches))
    lines = ["# Speculative decoding evaluation", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if r.batch_sweep:
        lines += ["", "## Batch-size sweep", "",
                  "| batch | prompts | tokens/s spec | tokens/s target | speedup | tau |", "|---|---|---|---|---|---|"]
        lines += [f"| {p.batch_size} | {p.num_prompts} | {_f(p.tokens_per_s, 2)} | {_f(p.target_only_tokens_per_s, 2)} "
                  f"| {_f(p.speedup)} | {_f(p.mean_accept_len)} |" for p in r.batch_sweep]
    lines += _output_positions(r)
    if r.by_category:
        lines += ["", "## Per category", "", "| category | prompts | tau | a_k per draft position |",
                  "|---|---|---|---|"]
        lines += [f"| {cat} | {c['prompts']} | {_f(c['tau'])} | {', '.join(_f(a) for a in c['accept_rate_per_pos'])} |"
                  for cat, c in r.by_category.items()]
    lines += _oracle(r)
    lines += _tree_and_cost_model(r)
    if r.hf:
        h = r.hf
        lines += ["", f"## Side by side with HF transformers (batch 1, {h['num_prompts']} prompts)", "",
                  "| method | tokens/s | identical to ours | time ours / HF |", "|---|---|---|---|",
                  f"| ours speculative | {_f(h['ours_tokens_per_s'], 2)} | - | - |",
                  f"| ours target-only | {_f(h['ours_target_only_tokens_per_s'], 2)} | - | - |"]
        for name, v in h.items():
            if isinstance(v, dict):
                lines.append(f"| {name} | {_f(v['tokens_per_s'], 2)} | {v['identical_outputs']}/{h['num_prompts']} "
                             f"| {_f(v['time_ratio_ours_over_hf'])} |")
    if r.mismatches:
        lines += ["", "## Greedy mismatches", "", "| prompt | position | top-2 logit margin |", "|---|---|---|"]
        lines += [f"| {m['prompt']} | {m['position']} | {m['top2_logit_margin']:.2e} |" for m in r.mismatches]
    env = r.env
    lines += ["", f"Device {env.get('device')}, {env.get('torch_threads')} torch threads, load average "
                  f"{env.get('loadavg_before')} -> {env.get('loadavg_after')} (CPU timings on a shared machine are "
                  "noisy).", ""]
    return "\n".join(lines)


def _ci(ci) -> str:
    return "" if ci is None else f" [{_f(ci[0])}, {_f(ci[1])}]"


def _output_positions(r: EvalResult) -> list[str]:
    """Acceptance by where in the output a round starts, per bucket, with 95% bootstrap intervals over prompts."""
    if not r.accept_by_output_position:
        return []
    lines = ["", "## Acceptance against output position", "",
             "A round belongs to the bucket of the output position where it starts; [95% CI]: bootstrap over the "
             "prompts that reached the bucket.", "",
             "| output tokens | prompts | rounds | tau [95% CI] | accepted / proposed drafts [95% CI] |",
             "|---|---|---|---|---|"]
    for b in r.accept_by_output_position:
        lines.append(f"| {bucket_label(b['start'], b['end'])} | {b.get('prompts', '-')} | {b['rounds']} "
                     f"| {_f(b['tau'])}{_ci(b.get('tau_ci95'))} "
                     f"| {_f(b['accept_rate'])}{_ci(b.get('accept_rate_ci95'))} |")
    return lines


def _oracle(r: EvalResult) -> list[str]:
    """eval.drafter=oracle: the speedup against the bound of a free, always-accepted draft, (gamma+1) / v(gamma+1)."""
    o = r.oracle
    if o is None:
        return []
    g = o.gamma
    rows = [("drafter", "oracle: the target's own greedy output replayed (every draft accepted, drafting free)"),
            ("gamma", g), ("tau (tokens per target forward)", _f(o.tau)),
            ("measured speedup (target-only time / speculative time, prefill included)", _f(o.speedup)),
            ("measured decode-only speedup", _f(o.decode_speedup)),
            (f"1-token forward / {g + 1}-token verify forward, ms",
             f"{_f(o.target_step_ms, 2)} / {_f(o.verify_ms, 2)}"),
            (f"v({g + 1}) = verify forward / 1-token forward", _f(o.v)),
            (f"**bound (gamma+1) / v({g + 1})**", _f(o.bound)),
            ("bound at the measured tau, tau / v", _f(o.bound_at_tau)),
            ("**efficiency = speedup / bound** (the decoder's own overhead)", _f(o.efficiency)),
            ("decode-only efficiency", _f(o.decode_efficiency))]
    return (["", "## Oracle drafter: the decoder's own overhead", "", "| metric | value |", "|---|---|"]
            + [f"| {k} | {v} |" for k, v in rows])


def _tree_and_cost_model(r: EvalResult) -> list[str]:
    """The token tree's SGLang flags and costs, and the cost model's settings and recommendation (eval/tree_cost.py)."""
    lines = []
    if r.tree:
        t = r.tree
        flags = " ".join(f"{k} {v}" for k, v in t.get("sglang", {}).items())
        served = (f"Served by SGLang with `{flags}`" if flags else
                  "No serving engine decodes this drafter's trees (specdistill's decoding only)")
        lines += ["", f"## Token tree {t['name']}", "", f"{served}; a_k above is acceptance by "
                  "depth (the accepted path reached depth k, given depth k-1)."]
        if "draft_round_ms" in t:
            lines.append(f"Draft {_f(t['draft_round_ms'], 2)} ms per round (d = {_f(t['d'])} target steps), verify of "
                         f"{t['nodes'] + 1} tokens {_f(t['verify_ms'], 2)} ms (v = {_f(t['v'])}).")
    if r.cost_model:
        lines += cost_model_markdown(r.cost_model)
    return lines


def curve(ax, xs: list, ys: list, ns: list, n_label: str = "n") -> None:
    """Points with their sample count written beside each; joined by a line only when there are two or more (a
    single point is not a curve). The y-axis starts at 0, so small differences are not drawn as large ones."""
    ax.plot(xs, ys, "o-" if len(xs) > 1 else "o")
    for x, y, n in zip(xs, ys, ns):
        ax.annotate(f"{n_label}={n}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    top = max([y for y in ys if y == y] + [1.0])
    ax.set_ylim(0, top * 1.15)
    if len(xs) == 1:
        ax.text(0.5, 0.05, "one point only: no curve", transform=ax.transAxes, ha="center", fontsize=8, color="grey")


def write_plots(r: EvalResult, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths[name] = out / name

    k = list(range(1, len(r.accept_rate_per_pos) + 1))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([x - 0.2 for x in k], r.accept_rate_per_pos, width=0.4, label="a_k (given accepted prefix)")
    ax.bar([x + 0.2 for x in k], r.reach_rate_per_pos, width=0.4, label="P(accepted | drafted)")
    ax.set(xlabel="draft position k", ylabel="acceptance", ylim=(0, 1.05), xticks=k,
           title=f"{r.drafter}: tau {r.mean_accept_len:.2f} (n={r.target_forwards} rounds, {r.num_prompts} prompts)")
    ax.legend(fontsize=8)
    save(fig, "accept_rate_per_pos.png")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    total = max(sum(r.accept_len_hist), 1)
    bars = ax.bar(range(len(r.accept_len_hist)), [h / total for h in r.accept_len_hist])
    ax.bar_label(bars, labels=[f"n={h}" for h in r.accept_len_hist], fontsize=7)
    ax.set(xlabel="accepted drafts per round", ylabel="share of rounds", xticks=range(len(r.accept_len_hist)),
           title="accepted-length histogram")
    save(fig, "accept_len_hist.png")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    pts = sorted(r.batch_sweep, key=lambda p: p.batch_size)
    curve(ax, [p.batch_size for p in pts], [p.speedup for p in pts], [p.num_prompts for p in pts], "prompts")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="batch size", ylabel="speedup vs target-only", title="speedup against batch size")
    ax.set_xscale("log", base=2)
    save(fig, "speedup_vs_batch_size.png")

    fig, (ax_tau, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.5))
    buckets = r.accept_by_output_position
    xs = list(range(len(buckets)))  # one slot per bucket: the buckets widen (0-127 .. 1024+)
    for ax, key, ylabel in ((ax_tau, "tau", "tau (tokens per target forward)"),
                            (ax_acc, "accept_rate", "accepted / proposed drafts")):
        curve(ax, xs, [b[key] for b in buckets], [b["rounds"] for b in buckets], "rounds")
        band = [(x, b[f"{key}_ci95"]) for x, b in zip(xs, buckets) if b.get(f"{key}_ci95") is not None]
        if band:
            ax.fill_between([x for x, _ in band], [ci[0] for _, ci in band], [ci[1] for _, ci in band], alpha=0.25,
                            label="95% CI (bootstrap over prompts)")
            ax.set_ylim(0, max(ax.get_ylim()[1], 1.1 * max(ci[1] for _, ci in band)))  # the whole band in view
            ax.legend(fontsize=7)
        ax.set(xlabel="output tokens before the round", ylabel=ylabel, xticks=xs,
               xticklabels=[bucket_label(b["start"], b["end"]) for b in buckets])
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("acceptance against output position", fontsize=10)
    save(fig, "accept_by_output_position.png")
    return paths
