"""The expert-selection comparison on an MoE target: hot / dense(hot) / random / cold drafts at equal
parameters and equal budget, plus an EAGLE-3 head whose MLP starts from hot experts against a plain head.

This module knows nothing of how drafts are built or trained: every arm is a set of Hydra overrides composed on one
base, built by specdistill.build and trained by the one loop (same steps, same micro-batches in the same order: same
trainer.seed and data), scored before and after training by
  - simulated tau on held-out data (eval/simulated.py, via the loop's heldout_before / heldout_after), and
  - the real, lossless speculative evaluator (train/spec_eval.py: greedy at eval.temperature=0) on eval.prompts,
and compared PAIRED over prompts against each arm's baseline (eval/stats.py: the bootstrap scripts/compare_evals.py
uses, so `compare_evals.py <arm>/eval/after <baseline>/eval/after` reproduces every interval here).

Arms (each: recipe + overrides; the routing profile is computed once and shared):
  hot         moe_kd, kind=moe,   selection=hot     the draft the toolkit proposes (baseline of the LM arms)
  dense       moe_kd, kind=dense, selection=hot     the same experts merged into one MLP (concat: same parameters
                                                    minus the router rows)
  random      moe_kd, kind=moe,   selection=random  the same count of seeded random experts per layer
  cold        moe_kd, kind=moe,   selection=cold    the least used experts
  eagle3      eagle3, plain head                    (baseline of eagle3_hot)
  eagle3_hot  eagle3, eagle3_mlp=true               the head's MLP merged from the hot experts of the last MoE layer;
                                                    with eagle3_experts=1 its MLP has the plain head's size

  python -m benchmarks.moe                                   # all arms, small budget, target=smollm2_moefied
  python -m benchmarks.moe --arms=hot,random,cold trainer.max_steps=40 --spread-prompts=16
  python -m benchmarks.moe --out=outputs/bench_moe_e8 target.path=/models/Qwen3-30B-A3B
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

BASE_TARGET = "target=smollm2_moefied"


@dataclass(frozen=True)
class Arm:
    name: str
    recipe: str
    overrides: tuple[str, ...]
    baseline: str  # the arm its paired ratio is taken against
    label: str


def arms(eagle3_experts: int = 1, random_seed: int = 0) -> dict[str, Arm]:
    lm = ("draft.moe.kind=moe",)
    return {a.name: a for a in (
        Arm("hot", "moe_kd", lm + ("draft.moe.selection=hot",), "hot", "hot experts, sliced router"),
        Arm("dense", "moe_kd", ("draft.moe.kind=dense", "draft.moe.selection=hot"), "hot",
            "dense merge of the hot experts"),
        Arm("random", "moe_kd", lm + ("draft.moe.selection=random", f"draft.moe.selection_seed={random_seed}"), "hot",
            f"random experts (seed {random_seed})"),
        Arm("cold", "moe_kd", lm + ("draft.moe.selection=cold",), "hot", "cold (least used) experts"),
        # draft.num_layers=1: SMALL's two layers are the LM drafts'; a head has one (refused otherwise)
        Arm("eagle3", "eagle3", ("draft.num_layers=1", "draft.moe.eagle3_mlp=false"), "eagle3", "EAGLE-3 head, plain"),
        Arm("eagle3_hot", "eagle3", ("draft.num_layers=1", "draft.moe.eagle3_mlp=true", "draft.moe.selection=hot",
                                     f"draft.moe.num_experts={eagle3_experts}", "draft.moe.coverage=null"),
            "eagle3", f"EAGLE-3 head, MLP from {eagle3_experts} hot expert(s)"),
    )}


# Sized for one busy CPU core (see docs/guide.md "MoE drafts"): every knob is an ordinary override the caller can beat.
SMALL = ("data.max_rows=300", "data.max_length=128", "data.heldout_size=16", "trainer.max_steps=8",
         "trainer.micro_batch_size=2", "trainer.grad_accum=1", "trainer.warmup_steps=1", "trainer.lr=3e-3",
         "trainer.log_every=2", "trainer.eval_every=0", "trainer.save_every=1000", "trainer.seed=0",
         "draft.num_layers=2", "draft.draft_vocab_size=8192", "draft.moe.num_experts=3", "draft.moe.coverage=null",
         "draft.moe.profile_batches=4",
         "eval.gamma=4", "eval.max_batches=2", "eval.spec_eval=false", "eval.prompts=embedded:mt_bench",
         "eval.num_prompts=2", "eval.max_new_tokens=24", "eval.warmup_prompts=0", "eval.measure_cost=false",
         "eval.temperature=0")


@dataclass
class PhaseScore:
    """One arm at one moment (before or after training)."""
    tau_sim: float  # simulated, held-out, teacher-forced
    top1_sim: float
    tau_real: Optional[float]  # the real evaluator on eval.prompts
    tau_real_ci95: Optional[list[float]]
    ratio_to_baseline: Optional[float]  # tau_real / the baseline arm's tau_real, same phase, same prompts
    ratio_ci95: Optional[list[float]]  # paired bootstrap over prompts
    accept_rate_per_pos: Optional[list[float]]
    greedy_mismatches: Optional[int]
    eval_dir: Optional[str]  # the evaluator's folder (results.json, outputs.jsonl): scripts/compare_evals.py input


@dataclass
class ArmResult:
    name: str
    label: str
    baseline: str
    params: int
    trainable_params: int
    selection: dict  # kind, selection, seed, kept expert ids per source layer, their routing-weight share
    steps: int
    loss_tokens: int
    train_loss_first: float
    train_loss_last: float
    seconds: float
    before: Optional[PhaseScore] = None
    after: Optional[PhaseScore] = None
    counts: dict = field(default_factory=dict)  # phase -> (N, 2) per prompt [new tokens, target forwards]
    prompts: dict = field(default_factory=dict)  # phase -> the N prompts, in the order of counts


# ------------------------------------------------------------------------------------------------ pure parts
@dataclass
class PerPrompt:
    """An evaluator run's per-prompt record, sorted by prompt text (compare_evals' pairing order)."""
    prompts: list[str]
    counts: list[list[int]]  # (N, 2) [new tokens, target forwards]


def per_prompt(outputs_jsonl: Path) -> PerPrompt:
    rows = [json.loads(x) for x in Path(outputs_jsonl).read_text().splitlines() if x.strip()]
    rows.sort(key=lambda r: r["prompt"])
    return PerPrompt([r["prompt"] for r in rows], [[r["new_tokens"], r["target_forwards"]] for r in rows])


def paired_scores(results: dict[str, ArmResult], phase: str, seed: int = 0) -> None:
    """Fill each arm's tau interval and paired ratio against its baseline arm (in place), for `phase`."""
    from specdistill.eval.stats import ratio_interval, tau_interval

    for r in results.values():
        s: PhaseScore = getattr(r, phase)
        c = r.counts.get(phase)
        if s is None or c is None:
            continue
        s.tau_real_ci95 = tau_interval(c, seed)
        b = results.get(r.baseline)
        cb = b.counts.get(phase) if b is not None else None
        if cb is not None and r.prompts.get(phase) != b.prompts.get(phase):
            raise ValueError(f"arms {r.name} and {r.baseline} were evaluated on different prompts ({phase}): a paired "
                             "interval needs the same eval.prompts and num_prompts in every arm")
        if cb is not None and getattr(b, phase).tau_real:
            s.ratio_to_baseline = s.tau_real / getattr(b, phase).tau_real
            s.ratio_ci95 = ratio_interval(c, cb, seed)


def verdict(results: dict[str, ArmResult], arm: str, phase: str = "after") -> str:
    """'better' / 'worse' when the paired interval of arm / its baseline excludes 1, else 'tie' (or '-')."""
    s = getattr(results[arm], phase)
    if s is None or s.ratio_ci95 is None or arm == results[arm].baseline:
        return "-"
    lo, hi = s.ratio_ci95
    return "better" if lo > 1 else "worse" if hi < 1 else "tie"


def markdown(summary: dict) -> str:
    res = summary["arms"]
    ci = lambda c: "" if not c else f" [{c[0]:.3f}, {c[1]:.3f}]"  # noqa: E731
    num = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [f"# MoE expert-selection comparison: {summary['target']}", "",
             f"Equal budget: {summary['budget']}. Real tau: {summary['eval']}. Paired 95% bootstrap intervals over "
             "prompts; each arm's ratio is to its baseline arm (same phase). Verdict: the after-training interval "
             "excludes 1.", "",
             "| arm | params | experts (coverage) | tau_sim before -> after | tau real before [CI] | "
             "tau real after [CI] | / baseline before [paired CI] | / baseline after [paired CI] | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]

    def ratio(name: str, s: dict) -> str:
        r = res[name]
        if s.get("ratio_to_baseline") is None or name == r["baseline"]:
            return "-"
        return f"{s['ratio_to_baseline']:.3f}x{ci(s.get('ratio_ci95'))} vs {r['baseline']}"

    for name, r in res.items():
        b, a = r["before"] or {}, r["after"] or {}
        sel = r["selection"]
        kept = f"{sel.get('experts')} ({sel.get('coverage')})" if sel.get("experts") is not None else "-"
        lines.append(f"| {name}: {r['label']} | {r['params']:,} | {kept} | {num(b.get('tau_sim'))} -> "
                     f"{num(a.get('tau_sim'))} | {num(b.get('tau_real'))}{ci(b.get('tau_real_ci95'))} | "
                     f"{num(a.get('tau_real'))}{ci(a.get('tau_real_ci95'))} | {ratio(name, b)} | {ratio(name, a)} | "
                     f"{summary['verdicts'].get(name, '-')} |")
    lines += ["", "| arm | train loss first -> last | loss tokens | steps | greedy mismatches (after) | seconds |",
              "|---|---|---|---|---|---|"]
    for name, r in res.items():
        a = r["after"] or {}
        lines.append(f"| {name} | {r['train_loss_first']:.4f} -> {r['train_loss_last']:.4f} | {r['loss_tokens']} | "
                     f"{r['steps']} | {a.get('greedy_mismatches', '-')} | {r['seconds']:.0f} |")
    lines += ["", f"Total {summary['seconds']:.0f} s. Command: `{summary['command']}`",
              "Reproduce an interval: `python scripts/compare_evals.py <arm>/eval/after <baseline>/eval/after "
              "--baseline <baseline>/eval/after`."]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> Path:
    """Real tau before/after per arm with its bootstrap interval, and simulated tau before/after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["arms"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "tau_real", "real tau (eval prompts)"),
                           (axes[1], "tau_sim", "simulated tau (held-out)")):
        for j, phase in enumerate(("before", "after")):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(names))]
            vals, lo, hi = [], [], []
            for n in names:
                s = summary["arms"][n][phase] or {}
                v = s.get(key) or float("nan")
                c = s.get(f"{key}_ci95") or [v, v]  # simulated tau has no interval (one aggregate count)
                vals.append(v), lo.append(v - c[0]), hi.append(c[1] - v)
            err = [lo, hi] if key == "tau_real" else None
            ax.bar(xs, vals, width=0.38, yerr=err, capsize=3, label=phase)
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_title(title)
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ the run
def run_arm(arm: Arm, cfg, log: Callable[[str], None] = print) -> ArmResult:
    """Build the arm, score it before training, train it, score it after."""
    import torch

    from specdistill.build import build
    from specdistill.moe.build import draft_param_count
    from specdistill.train.loop import fit
    from specdistill.train.spec_eval import run_spec_eval

    t0 = time.perf_counter()
    torch.manual_seed(0)
    c = build(cfg)
    draft = c.accelerator.unwrap_model(c.models.draft)
    selection = _selection_of(draft, cfg)
    params = draft_param_count(draft)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    log(f"[bench] {arm.name}: {arm.label}, {params:,} parameters ({trainable:,} trainable), {selection}")
    run_spec_eval(c, 0, 0, name="before")
    res = fit(c)
    run_spec_eval(c, 1, res.step, name="after")
    out = ArmResult(name=arm.name, label=arm.label, baseline=arm.baseline, params=params, trainable_params=trainable,
                    selection=selection, steps=res.step, loss_tokens=int(res.history[-1]["tokens_seen"]),
                    train_loss_first=float(res.history[0]["train/loss"]),
                    train_loss_last=float(res.history[-1]["train/loss"]), seconds=0.0)
    for phase, held in (("before", res.heldout_before), ("after", res.heldout_after)):
        d = Path(c.output_dir) / "eval" / phase
        rj = json.loads((d / "results.json").read_text())
        pp = per_prompt(d / "outputs.jsonl")
        out.counts[phase], out.prompts[phase] = pp.counts, pp.prompts
        setattr(out, phase, PhaseScore(
            tau_sim=held["heldout/mean_accept_len"], top1_sim=held["heldout/top1_agreement"],
            tau_real=rj["mean_accept_len"], tau_real_ci95=None, ratio_to_baseline=None, ratio_ci95=None,
            accept_rate_per_pos=rj.get("accept_rate_per_pos"), greedy_mismatches=rj.get("greedy_mismatches"),
            eval_dir=str(d)))
    out.seconds = round(time.perf_counter() - t0, 1)
    del c, draft
    return out


def _selection_of(draft, cfg) -> dict:
    """What the arm's draft says about its experts (config.specdistill_moe), or the EAGLE-3 MLP's source."""
    meta = getattr(draft.config, "specdistill_moe", None)
    if meta:
        return {k: meta.get(k) for k in ("kind", "selection", "selection_seed", "source_layers", "experts",
                                         "coverage")}
    m = cfg.draft.moe
    if m.eagle3_mlp:  # an EAGLE-3 head's config has no provenance field: recompute its (pure, seeded) choice
        from specdistill.moe.build import select_experts, selection_record
        from specdistill.moe.profiler import RoutingProfile

        prof = RoutingProfile.load(m.profile)  # the bench always passes its saved profile
        layers = list(m.eagle3_layers) if m.eagle3_layers else [max(prof.layers)]
        chosen = select_experts(prof, layers, m.coverage, m.num_experts, m.selection, m.selection_seed)
        return {"kind": "eagle3_mlp", "source_layers": layers, "experts": [chosen[s] for s in layers],
                **selection_record(prof, chosen, m.selection, m.selection_seed)}
    return {"kind": cfg.draft.init}


def profile_target(cfg, out: Path, log=print) -> Path:
    """The target's routing on the training data, once for every arm (profile.json, heatmap.png)."""
    from specdistill.build import build_target, build_tokenizer
    from specdistill.data.dataset import build_data
    from specdistill.moe.profiler import calibration_batches, plot_heatmap, profile_routing
    from specdistill.entry import load_config

    cfg = load_config(cfg, log=None)
    target, tok = build_target(cfg.target), build_tokenizer(cfg)
    data = build_data(cfg.data, tok)
    m = cfg.draft.moe
    prof = profile_routing(target.model, calibration_batches(data.train, tok.pad_token_id, m.profile_batches),
                           m.token_selection, source={"target": str(cfg.target.path), "data": str(cfg.data.path)})
    path = prof.save(out / "profile.json", coverage=0.9)
    plot_heatmap(prof, out / "heatmap.png", coverage=0.9)
    log(f"[bench] routing profile of {prof.tokens} tokens over {len(prof.layers)} MoE layers -> {path}")
    return path


def bench(overrides: list[str], out: Path, names: Optional[list[str]] = None, eagle3_experts: int = 1,
          random_seed: int = 0, command: str = "", spread_prompts: Optional[int] = None, log=print) -> dict:
    """Run the arms `names` (default: all) with `overrides` on top of SMALL; write results.json, results.md,
    results.png, profile.json and heatmap.png to `out`."""
    from benchmarks.recipes import compose

    t0 = time.perf_counter()
    table = arms(eagle3_experts, random_seed)
    names = list(names or table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown bench arms {unknown}: choose from {list(table)}")
    for n in names:  # a ratio needs its baseline in the same run
        if table[n].baseline not in names:
            raise ValueError(f"arm {n!r} is compared against {table[n].baseline!r}: add it to --arms")
    out.mkdir(parents=True, exist_ok=True)
    base = [BASE_TARGET, "run_name=bench_moe", *SMALL, *overrides]

    def arm_cfg(arm: Arm, extra: tuple[str, ...] = ()):
        return compose(arm.recipe, [*base, *arm.overrides, *extra])

    first = arm_cfg(table[names[0]])
    if spread_prompts:  # eval.prompts is ordered (MT-bench: by category): take evenly spaced prompts, not the first N
        base += [f"eval.prompts={spread_subset(first.eval.prompts, spread_prompts, out / 'prompts.jsonl')}",
                 "eval.num_prompts=null"]
        first = arm_cfg(table[names[0]])
    _ensure_target(first.target.path, log)
    prof_path = profile_target(arm_cfg(table["hot"]), out, log)
    results: dict[str, ArmResult] = {}
    for i, n in enumerate(names):
        done = [r.seconds for r in results.values()]
        eta = f", about {sum(done) / len(done) * (len(names) - i):.0f}s to go" if done else ""
        log(f"[bench] arm {i + 1}/{len(names)}: {n} ({time.perf_counter() - t0:.0f}s so far{eta})")
        cfg = arm_cfg(table[n], (f"draft.moe.profile={prof_path}", f"trainer.output_dir={out / n}",
                                 "trainer.resume=null"))
        results[n] = run_arm(table[n], cfg, log)
    for phase in ("before", "after"):
        paired_scores(results, phase)
    summary = {"target": str(first.target.path), "command": command, "overrides": base,
               "budget": (f"{first.trainer.max_steps} steps of {first.trainer.micro_batch_size} rows x "
                          f"{first.trainer.grad_accum} micro-batches, <= {first.data.max_length} tokens a row, "
                          f"trainer.seed {first.trainer.seed}"),
               "eval": (f"{first.eval.prompts}, "
                        f"{len(next(iter(results.values())).counts.get('after', [])) or first.eval.num_prompts} "
                        f"prompts x {first.eval.max_new_tokens} "
                        f"tokens, T={first.eval.temperature}, gamma {first.eval.gamma}"),
               "profile": str(prof_path),
               "arms": {n: {k: v for k, v in asdict(r).items() if k not in ("counts", "prompts")}
                        for n, r in results.items()},
               "counts": {n: r.counts for n, r in results.items()},
               "verdicts": {n: verdict(results, n) for n in results},
               "seconds": round(time.perf_counter() - t0, 1)}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(markdown(summary))
    plot(summary, out / "results.png")
    log(markdown(summary))
    return summary


def spread_subset(source: str, n: int, path: Path) -> Path:
    """Write `n` evenly spaced first turns of prompt `source` (indices round(i * len / n)) to a .jsonl of messages."""
    from specdistill.data.prompts import load_prompt_messages

    rows, _ = load_prompt_messages(source)
    if not 1 <= n <= len(rows):
        raise ValueError(f"--spread-prompts={n}: {source} has {len(rows)} prompts; choose 1..{len(rows)}")
    picked = [rows[round(i * len(rows) / n)][1] for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in picked))
    return path


def _ensure_target(path: str, log) -> None:
    from specdistill.moe.upcycle import ensure_default_target

    ensure_default_target(path, log=log)  # the upcycled smollm2_moe folder is made on demand; others must exist
    if "moefied" in str(path) and not (Path(path).expanduser() / "config.json").exists():
        raise FileNotFoundError(f"the MoEfied target {path} does not exist yet: create it once with "
                                "`python scripts/moefy.py --experts 8 --top-k 6 --tokens 16384` (minutes)")


def main(argv=None) -> dict:
    """`python -m benchmarks.moe [--name=value ...] [hydra overrides]`: the bench's own options (--name=value); every
    other argument is a Hydra override applied to every arm (as train.py takes them)."""
    from specdistill.threads import configure_threads

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/bench_moe")
    ap.add_argument("--arms", default=",".join(arms()), help="comma-separated subset of " + ",".join(arms()))
    ap.add_argument("--eagle3-experts", type=int, default=1,
                    help="hot experts merged into the EAGLE-3 head's MLP (1: the plain head's size)")
    ap.add_argument("--random-seed", type=int, default=0, help="draft.moe.selection_seed of the random arm")
    ap.add_argument("--spread-prompts", type=int, default=None,
                    help="evaluate N evenly spaced prompts of eval.prompts (MT-bench is ordered by category)")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        ap.error(f"unknown options {bad}; Hydra overrides are key=value")
    configure_threads(None, "trainer.threads")  # physical cores / local processes (or OMP_NUM_THREADS), printed
    command = "python -m benchmarks.moe " + " ".join(shlex.quote(a) for a in argv)
    return bench(overrides, Path(args.out), [a for a in args.arms.split(",") if a], args.eagle3_experts,
                 args.random_seed, command=command.strip(), spread_prompts=args.spread_prompts)


if __name__ == "__main__":
    main()
