"""`specdistill-bench`: the training recipes against each other (same target, data and compute budget), scored by
the real speculative evaluator (specdistill.eval) on MT-bench at gamma 4, temperature 0 and 1.

  specdistill-bench --steps 200 --micro-batch-size 8 --num-prompts 80 --max-new-tokens 128
  specdistill-bench --steps 2 --micro-batch-size 2 --num-prompts 2 --max-new-tokens 16 \
      --rollout-tokens 8 --max-length 128 --max-rows 64 --no-cost --out outputs/bench_smoke      # CPU smoke

Variants: kd, eagle3, draft_opd and its ablations (no_replay: objective.replay=false, no_weighting:
objective.weighting=none, no_assist: objective.assist=false), optionally draft_opd_kd_mix (objective.kd_weight=1:
on-policy plus KD on the data batch) and draft_opd_eagle3 (an EAGLE-3 head trained on-policy, no replay), `init` (the
untrained from_target draft every standalone variant starts from) and `init_eagle3` (the head eagle3 and
draft_opd_eagle3 start from). A warm start for all of them: --override draft.path=... (and --opd-warm-start for a
standalone draft when the EAGLE-3 variants run alongside). Variants can run in parallel processes with separate
--out folders and the same knobs; --merge then joins them into one table.

Compute budget (--budget, recorded per run in results.json):
  steps          (default) every variant makes the same number of optimizer steps on the same micro-batches (same
                 data order and seed: step s reads the same conversations, whose prompts draft_opd rolls out);
  target_tokens  draft_opd (the full variant) runs --steps steps first; every other variant then gets as many
                 steps as it takes to run the target over the same number of tokens (kd / eagle3: one target forward
                 per micro-batch over its tokens; draft_opd: prefill + verification tokens of the rollouts).
Either way each run records optimizer steps, target-forward tokens, trained positions and wall seconds.
Writes <out>/results.json, <out>/results.md, <out>/tau.png; each run's checkpoints under <out>/runs/<variant>/.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

# recipe=draft_opd's on-policy phase alone (no warm-up, the benchmark's --data, a standalone draft, no EAGLE-3 export):
# like every other variant, it trains from the benchmark's own start (--override draft.path=... / --opd-warm-start)
OPD = ["warmup.mode=never", "data.regenerate.enabled=false", "draft=from_target", "trainer.export_formats=[]"]
VARIANTS = {
    "init": None,  # the untrained from_target draft (no training)
    "init_eagle3": None,  # the untrained EAGLE-3 head of the eagle3 recipe (no training)
    "kd": ("kd", []),
    "eagle3": ("eagle3", []),
    "draft_opd": ("draft_opd", OPD),
    "draft_opd_no_replay": ("draft_opd", OPD + ["objective.replay=false"]),
    "draft_opd_no_weighting": ("draft_opd", OPD + ["objective.weighting=none"]),
    "draft_opd_no_assist": ("draft_opd", OPD + ["objective.assist=false"]),
    "draft_opd_kd_mix": ("draft_opd", OPD + ["objective.kd_weight=1.0"]),
    "draft_opd_eagle3": ("draft_opd", OPD + ["draft=eagle3", "objective.replay=false"]),
}
INIT_RECIPES = {"init": "kd", "init_eagle3": "eagle3"}  # whose draft group builds each untrained baseline
OFF_POLICY_VARIANTS = ("kd", "eagle3")  # the variants trained on the data alone (no rollouts)
DEFAULT = ["init", "kd", "eagle3", "draft_opd", "draft_opd_no_replay", "draft_opd_no_weighting", "draft_opd_no_assist"]


def parse_args(argv=None):
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--variants", nargs="+", default=DEFAULT, choices=sorted(VARIANTS))
    a.add_argument("--target", default="embedded:smollm2-135m-instruct")
    a.add_argument("--data", default="embedded:sharegpt")
    a.add_argument("--max-rows", type=int, default=2000, help="data rows read")
    a.add_argument("--max-length", type=int, default=384, help="data.max_length (training conversations)")
    a.add_argument("--steps", type=int, default=40, help="optimizer steps (the budget, or draft_opd's share of it)")
    a.add_argument("--budget", choices=("steps", "target_tokens"), default="steps")
    a.add_argument("--micro-batch-size", type=int, default=4)
    a.add_argument("--grad-accum", type=int, default=1)
    a.add_argument("--lr", type=float, default=None, help="null: each recipe's own")
    a.add_argument("--rollout-tokens", type=int, default=32, help="draft_opd objective.max_new_tokens")
    a.add_argument("--opd-warm-start", default=None, help="draft.path of a standalone draft for the draft_opd variants")
    a.add_argument("--prompts", default="embedded:mt_bench")
    a.add_argument("--num-prompts", type=int, default=80)
    a.add_argument("--max-new-tokens", type=int, default=128, help="evaluation tokens per prompt")
    a.add_argument("--gamma", type=int, default=4)
    a.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    a.add_argument("--eval-batch-size", type=int, default=1,
                   help="prompts decoded together in the evaluation (tau does not depend on it; tok/s does)")
    a.add_argument("--no-cost", action="store_true", help="skip the evaluator's draft/target cost timing")
    a.add_argument("--threads", type=int, default=None)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--out", default="outputs/bench_recipes")
    a.add_argument("--overwrite", action="store_true", help="delete <out>/runs/<variant> from an earlier run")
    a.add_argument("--append", action="store_true",
                   help="keep the variants already in <out>/results.json (same knobs) and run only the missing ones")
    a.add_argument("--only", nargs="+", default=None, choices=sorted(VARIANTS),
                   help="run just these of --variants now (with --append: one short invocation per variant)")
    a.add_argument("--override", nargs="*", default=[], help="extra Hydra overrides for every training run")
    a.add_argument("--reeval", action="store_true",
                   help="with --append: evaluate the --only variants again from their saved final checkpoints, "
                        "no training (adds per-prompt counts and tau intervals to an older results.json)")
    a.add_argument("--merge", nargs="*", default=[], metavar="DIR",
                   help="other --out folders of the same benchmark (run in parallel): their variants join this table")
    args = a.parse_args(argv)
    if min(args.steps, args.num_prompts, args.max_new_tokens, args.gamma, args.eval_batch_size) < 1:
        a.error("--steps, --num-prompts, --max-new-tokens, --gamma and --eval-batch-size must be >= 1")
    return args


def compose(recipe: str, overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specdistill.config import CONF_DIR, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=[f"recipe={recipe}"] + overrides)


def common_overrides(args, name: str, steps: int) -> list[str]:
    out = [f"target.path={args.target}", f"data.path={args.data}", f"data.max_rows={args.max_rows}",
           f"data.max_length={args.max_length}", f"trainer.max_steps={steps}", f"trainer.seed={args.seed}",
           f"trainer.micro_batch_size={args.micro_batch_size}", f"trainer.grad_accum={args.grad_accum}",
           f"trainer.output_dir={Path(args.out) / 'runs' / name}", f"trainer.save_every={steps}",
           "trainer.eval_every=0", f"trainer.log_every={max(1, min(5, steps))}", "trainer.warmup_steps=" +
           str(min(4, max(steps // 10, 0))), "eval.max_batches=2", "eval.spec_eval=false", f"run_name=bench_{name}"]
    if args.lr is not None:
        out.append(f"trainer.lr={args.lr}")
    return out + list(args.override)


def data_target_tokens(c, steps: int) -> tuple[int, int]:
    """(target-forward tokens, loss tokens) of `steps` optimizer steps of an offline recipe: one target forward per
    micro-batch over its real tokens; the same micro-batches the loop reads."""
    from specdistill.data.loader import StepBatches

    t = c.cfg.trainer
    sb = StepBatches(c.data.train, t.micro_batch_size, t.grad_accum, c.models.tokenizer.pad_token_id, t.seed)
    fwd = loss = 0
    for s in range(steps):
        for b in sb.micro_batches(s):
            fwd += int(b["attention_mask"].sum())
            loss += int(b["loss_mask"].sum())
    return fwd, loss


def steps_for_target_tokens(c, budget: int, cap: int) -> int:
    from specdistill.data.loader import StepBatches

    t = c.cfg.trainer
    sb = StepBatches(c.data.train, t.micro_batch_size, t.grad_accum, c.models.tokenizer.pad_token_id, t.seed)
    used, s = 0, 0
    while used < budget and s < cap:
        used += sum(int(b["attention_mask"].sum()) for b in sb.micro_batches(s))
        s += 1
    return max(s, 1)


def train(args, name: str, steps: int, log=print) -> dict:
    from specdistill.pipeline.run import build_components as build  # with the regeneration stage
    from specdistill.train.loop import fit

    from specdistill.drafts import saved_kind

    recipe, extra = VARIANTS[name]
    listed = compose(recipe, common_overrides(args, name, steps) + extra)  # the variant as VARIANTS lists it
    kind = variant_kind(listed)
    if args.opd_warm_start and recipe == "draft_opd" and saved_kind(args.opd_warm_start) is kind:
        extra = extra + kind.warm_start_overrides(args.opd_warm_start)  # the variants of the saved draft's kind
    if recipe == "draft_opd":
        extra = extra + [f"objective.max_new_tokens={args.rollout_tokens}", f"objective.gamma={args.gamma}"]
    if "steps" in listed.objective:  # a training-time-test unroll (eagle3) covers the gamma drafts the eval makes
        extra = extra + [f"objective.steps={args.gamma}"]
    run_dir = Path(args.out) / "runs" / name
    if run_dir.exists():
        if not args.overwrite:
            raise FileExistsError(f"{run_dir} exists from an earlier benchmark: pass --overwrite or another --out")
        shutil.rmtree(run_dir)
    cfg = compose(recipe, common_overrides(args, name, steps) + extra)
    c = build(cfg)
    t0 = time.perf_counter()
    res = fit(c)
    seconds = time.perf_counter() - t0
    if recipe == "draft_opd":
        fwd, trained = c.objective.state.target_tokens_total, int(res.history[-1].get("tokens_seen", 0))
    else:
        fwd, trained = data_target_tokens(c, res.step)
    log(f"[bench] {name}: {res.step} steps, {fwd} target-forward tokens, {trained} trained positions, {seconds:.1f} s")
    return {"components": c, "steps": res.step, "target_forward_tokens": fwd, "trained_positions": trained,
            "train_seconds": seconds, "checkpoint": str(res.final_checkpoint), "config": run_config(cfg),
            "last_train_metrics": {k: v for k, v in res.history[-1].items() if k.startswith("train/")}}


def reeval_recipe(args, name: str, run: dict) -> tuple[str, list[str]]:
    """(recipe, overrides) that build the models with a saved variant's final draft (init variants: as built)."""
    if name in INIT_RECIPES:
        return INIT_RECIPES[name], common_overrides(args, name + "_reeval", 1)
    recipe, extra = VARIANTS[name]
    kind = variant_kind(compose(recipe, common_overrides(args, name, 1) + extra))
    # The recipe named after the kind's data objective (kd / eagle3) builds it; its saved draft replaces the built one.
    return (kind.data_objective,
            common_overrides(args, name + "_reeval", 1) + kind.warm_start_overrides(Path(run["checkpoint"]) / "draft"))


def variant_kind(cfg):
    """The draft kind (drafts/: its adapter class) a composed variant config trains."""
    from specdistill.drafts import kind_for_init

    return kind_for_init(cfg.draft.init)


def run_config(cfg) -> dict:
    from omegaconf import OmegaConf

    return {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("objective", "draft", "trainer")}


def evaluate_draft(args, c, draft, prompts, temperature: float, log=print) -> dict:
    from specdistill.config import EvalConfig
    from specdistill.eval.stats import tau_interval
    from specdistill.eval.evaluator import evaluate

    target = c.models.target.model
    ecfg = EvalConfig(gamma=args.gamma, prompts=args.prompts, num_prompts=args.num_prompts,
                      max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed,
                      batch_size=args.eval_batch_size, batch_sizes=[args.eval_batch_size],
                      sweep_prompts=args.num_prompts, warmup_prompts=min(1, args.num_prompts),
                      measure_cost=not args.no_cost, output_dir=str(Path(args.out) / "eval"))
    was = draft.training
    draft.eval()
    try:
        r = evaluate(target, c.models.tokenizer, draft, prompts, ecfg, progress=False, log=log)
    finally:
        draft.train(was)
    per_prompt = [[x["new_tokens"], x["target_forwards"]] for x in r.samples]
    return {"mean_accept_len": r.mean_accept_len, "tau_ci95": tau_interval(per_prompt, args.seed),
            "per_prompt_tokens_forwards": per_prompt, "alpha": r.alpha, "speedup": r.speedup,
            "accept_rate_per_pos": r.accept_rate_per_pos, "tokens_per_s": r.tokens_per_s,
            "target_only_tokens_per_s": r.target_only_tokens_per_s, "greedy_mismatches": r.greedy_mismatches,
            "new_tokens": r.new_tokens, "predicted_speedup": r.predicted_speedup}


def size_knobs(args) -> dict:
    """What makes two benchmark runs comparable (checked by --append and --merge)."""
    keys = ("target", "data", "max_rows", "max_length", "steps", "budget", "micro_batch_size", "grad_accum", "lr",
            "rollout_tokens", "opd_warm_start", "prompts", "num_prompts", "max_new_tokens", "gamma", "temperatures",
            "eval_batch_size",
            "seed", "override")
    return {k: getattr(args, k) for k in keys}


def write_outputs(args, results: dict, budget: dict, knobs: dict) -> dict[str, Path]:
    from specdistill.eval.stats import ratio_interval

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"knobs": knobs, "budget": budget, "argv": sys.argv[1:]}
    (out / "results.json").write_text(json.dumps({"meta": meta, "variants": results}, indent=1))
    temps = args.temperatures
    head = ["variant", "steps", "target-fwd tokens", "trained positions", "train s"]
    for T in temps:
        head += [f"tau T={T:g}", f"alpha T={T:g}", f"speedup T={T:g}"]
    lines = [f"# Recipes on {args.target}, MT-bench-style prompts ({args.prompts}, {args.num_prompts} prompts, "
             f"{args.max_new_tokens} new tokens), gamma {args.gamma}",
             "", f"Budget: {budget['unit']} ({budget['description']}).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        row = [name, str(r.get("steps", 0)), str(r.get("target_forward_tokens", 0)), str(r.get("trained_positions", 0)),
               f"{r.get('train_seconds', 0.0):.1f}"]
        for T in temps:
            e = r["eval"][f"T={T:g}"]
            ci = e.get("tau_ci95")
            tau = f"{e['mean_accept_len']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
            row += [tau, f"{e['alpha']:.3f}", f"{e['speedup']:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "tau: tokens per target forward, [95% bootstrap interval over prompts] where recorded."]
    off = [n for n in OFF_POLICY_VARIANTS if n in results]
    on = [n for n in results if n.startswith("draft_opd")]
    if off and on:  # the goal: draft_opd's tau >= 1.15 x the best off-policy recipe's at equal budget
        lines.append("")
        for T in temps:
            tau = lambda n: results[n]["eval"][f"T={T:g}"]["mean_accept_len"]  # noqa: E731
            best = max(off, key=tau)
            parts = []
            for n in on:
                ci = ratio_interval(results[n]["eval"][f"T={T:g}"].get("per_prompt_tokens_forwards") or [],
                                    results[best]["eval"][f"T={T:g}"].get("per_prompt_tokens_forwards") or [],
                                    args.seed)
                parts.append(f"{n} {tau(n) / tau(best):.3f}x" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""))
            lines.append(f"T={T:g}: tau / best off-policy ({best}, {tau(best):.3f}): " + ", ".join(parts))
        lines.append("[paired 95% bootstrap interval over prompts, where both runs recorded per-prompt counts]")
    (out / "results.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(names)), 3.5))
    width = 0.8 / len(temps)
    for k, T in enumerate(temps):
        taus = [results[n]["eval"][f"T={T:g}"]["mean_accept_len"] for n in names]
        ax.bar([i + k * width for i in range(len(names))], taus, width, label=f"T={T:g}")
    ax.set_xticks([i + width * (len(temps) - 1) / 2 for i in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel(f"tau, gamma {args.gamma}")
    ax.set_title(f"{budget['unit']} budget: {budget['description'][:60]}", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tau.png", dpi=120)
    plt.close(fig)
    return {"json": out / "results.json", "md": out / "results.md", "plot": out / "tau.png"}


def main(argv: list[str] | None = None) -> None:
    """The console entry point (`specdistill-bench`; scripts/bench_recipes.py): run_bench with the command line."""
    run_bench(argv)


def run_bench(argv: list[str] | None = None) -> dict:
    """Train and evaluate every selected variant; returns {variant: results} (also written under --out)."""
    import torch

    from specdistill.pipeline.run import build_components as build  # with the regeneration stage
    from specdistill.data.prompts import load_prompts
    from specdistill.decoding.kv import max_positions

    args = parse_args(argv)
    from specdistill.threads import configure_threads

    configure_threads(args.threads, "--threads")
    log = print
    results: dict = {}
    prompts = None
    knobs = size_knobs(args)
    previous = Path(args.out) / "results.json"
    sources = [previous] if args.append and previous.exists() else []
    sources += [Path(d) / "results.json" for d in args.merge]
    for src in sources:  # earlier runs of the same benchmark: their variants are kept, not rerun
        if not src.exists():
            raise FileNotFoundError(f"--merge: {src} does not exist (a benchmark --out folder holds results.json)")
        old = json.loads(src.read_text())
        if old["meta"].get("knobs") != knobs:
            raise ValueError(f"{src} was made with other settings ({old['meta'].get('knobs')} vs {knobs}): only "
                             "runs of the same benchmark can share a table; use another --out")
        results.update({k: v for k, v in old["variants"].items() if k not in results})
        log(f"[bench] keeping {sorted(old['variants'])} from {src}")

    def eval_all(c, draft) -> dict:
        nonlocal prompts
        if prompts is None:  # one prompt set for every variant
            prompts = load_prompts(args.prompts, c.models.tokenizer, num_prompts=args.num_prompts,
                                   max_new_tokens=args.max_new_tokens, context=max_positions(c.models.target.model))
        out = {f"T={T:g}": evaluate_draft(args, c, draft, prompts, T, log) for T in args.temperatures}
        for T in args.temperatures:
            e = out[f"T={T:g}"]
            log(f"[bench] T={T:g}: tau {e['mean_accept_len']:.3f}, alpha {e['alpha']:.3f}, speedup {e['speedup']:.3f}x")
        return out

    def budget_now() -> dict:
        if args.budget == "steps":
            return {"unit": "optimizer steps", "steps": args.steps,
                    "description": f"{args.steps} optimizer steps of {args.micro_batch_size} x {args.grad_accum} "
                                   "conversations/prompts each, same data order; target-forward tokens recorded"}
        return {"unit": "target-forward tokens", "target_forward_tokens": budget_tokens,
                "description": f"{budget_tokens} tokens through the target (draft_opd's {args.steps} steps); "
                               "steps per variant recorded"}

    def save() -> dict[str, Path]:  # after every variant: an interrupted benchmark keeps what it measured
        return write_outputs(args, {n: results[n] for n in args.variants if n in results}, budget_now(), knobs)

    budget_tokens = results.get("draft_opd", {}).get("target_forward_tokens") if args.budget == "target_tokens" \
        else None
    if args.reeval:
        if not args.append or not args.only:
            raise ValueError("--reeval re-scores saved variants: pass --append and --only <variants>")
        for name in args.only:
            if name not in results:
                raise ValueError(f"--reeval: {name} is not in {previous}; run it first")
            c = build(compose(*reeval_recipe(args, name, results[name])))
            results[name]["eval"] = eval_all(c, c.accelerator.unwrap_model(c.models.draft))
            del c
            save()
    todo = [v for v in args.variants if v not in results and (args.only is None or v in args.only)]
    for name, recipe in INIT_RECIPES.items():  # the drafts the trained variants start from, untrained
        if name in todo:
            c0 = build(compose(recipe, common_overrides(args, name, 1)))
            results[name] = {"steps": 0, "target_forward_tokens": 0, "trained_positions": 0, "train_seconds": 0.0,
                             "eval": eval_all(c0, c0.accelerator.unwrap_model(c0.models.draft))}
            del c0
            save()
    # target_tokens: draft_opd first, its target-forward tokens are the budget of the others
    order = [v for v in todo if v not in INIT_RECIPES]
    if args.budget == "target_tokens" and budget_tokens is None:
        if "draft_opd" not in order:
            raise ValueError("--budget target_tokens measures the budget on the draft_opd variant: include it")
        order = ["draft_opd"] + [v for v in order if v != "draft_opd"]
    for name in order:
        steps = args.steps
        if budget_tokens is not None and VARIANTS[name][0] != "draft_opd":
            probe = build(compose(VARIANTS[name][0], common_overrides(args, name + "_probe", 1)))
            steps = steps_for_target_tokens(probe, budget_tokens, cap=100 * args.steps)
            del probe  # on-policy variants keep draft_opd's steps (their target tokens per step are alike)
        run = train(args, name, steps, log)
        if name == "draft_opd" and args.budget == "target_tokens":
            budget_tokens = run["target_forward_tokens"]
        c = run.pop("components")
        run["eval"] = eval_all(c, c.accelerator.unwrap_model(c.models.draft))
        results[name] = run
        del c
        save()
    paths = save()
    log(f"[bench] wrote {', '.join(str(p) for p in paths.values())}")
    log(paths["md"].read_text())
    return {n: results[n] for n in args.variants if n in results}


if __name__ == "__main__":
    main()
