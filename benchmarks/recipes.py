"""The training recipes against each other (same target, data and compute budget), scored by
the real speculative evaluator (specdistill.eval) on MT-bench at gamma 4, temperature 0 and 1.

  python -m benchmarks.recipes --steps 200 --micro-batch-size 8 --num-prompts 80 --max-new-tokens 128
  python -m benchmarks.recipes --steps 2 --micro-batch-size 2 --num-prompts 2 --max-new-tokens 16 \
      --rollout-tokens 8 --max-length 128 --max-rows 64 --no-cost --out outputs/bench_smoke      # CPU smoke

Variants: kd, eagle3, draft_opd and its ablations (no_replay: objective.replay=false, no_weighting:
objective.weighting=none, no_assist: objective.assist=false), optionally draft_opd_kd_mix (objective.kd_weight=1:
on-policy plus KD on the data batch), `init` (the untrained from_target draft every standalone variant starts from) and
`init_eagle3` (the untrained head of recipe eagle3). From one EAGLE-3 head (--variants head, with --override
draft.path=<head>): eagle3_regen (recipe eagle3_serve's off-policy objective on its regenerated data, the cached store
reused) against draft_opd_eagle3 (Draft-OPD on the head, replay on) and its _no_replay / _no_weighting ablations (a
head cannot decode without the target's features, so it has no no_assist arm). A warm start for all of them:
--override draft.path=... (and --opd-warm-start for a standalone draft when the EAGLE-3 variants run alongside).
Variants can run in parallel processes with separate --out folders and the same knobs; --merge then joins them into
one table.

Compute budget (--budget, recorded per run in results.json):
  steps          (default) every variant makes the same number of optimizer steps on the same micro-batches (same
                 data order and seed: step s reads the same conversations, whose prompts draft_opd rolls out);
  target_tokens  draft_opd (the full variant) runs --steps steps first; every other variant then gets as many
                 steps as it takes to run the target over the same number of tokens (kd / eagle3: one target forward
                 per micro-batch over its tokens; draft_opd: prefill + verification tokens of the rollouts).
  wall_time      every variant trains until --minutes of training wall time (trainer.max_minutes; --steps is then the
                 step cap and the LR schedule's horizon). Run the variants one after another on the same machine.
--checkpoints-at F1 F2 ..: each variant's ONE run is scored at those fractions of its budget (its checkpoints at
f x steps / f x the on-policy reference's target tokens / f x minutes: a wall-time run is stopped at each fraction,
scored, and resumed exactly), so the trend with the budget shows without retraining.
Scoring: the real evaluator at each --temperatures under --draft-policy (greedy: the serving engines' policy), tau and
a_k overall and per prompt category, and each arm's tau against the best off-policy arm at the same budget point as a
paired bootstrap interval over prompts (specdistill.eval.compare, the code of scripts/compare_evals.py).
Each run records optimizer steps, target-forward tokens, trained positions and wall seconds.
Writes <out>/results.json, <out>/results.md (with the command), <out>/tau.png and <out>/tau_vs_budget.png; each
run's checkpoints under <out>/runs/<variant>/.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

# recipe=draft_opd's on-policy phase alone (no warm-up, the benchmark's --data, a standalone draft, no EAGLE-3 export):
# like every other variant, it trains from the benchmark's own start (--override draft.path=... / --opd-warm-start)
OPD = ["warmup.mode=never", "data.regenerate.enabled=false", "draft=from_target", "trainer.export_formats=[]"]
OPD_HEAD = ["warmup.mode=never", "draft=eagle3", "trainer.export_formats=[]"]  # the on-policy phase of an EAGLE-3 head
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
    # From a strong EAGLE-3 head (--override draft.path=<head>): the off-policy continuation on recipe eagle3_serve's
    # regenerated data (its data.regenerate store, reused from the cache) against Draft-OPD and its ablations, whose
    # rollouts start from the same store's prompts (recipe draft_opd's on-policy phase, no warm-up).
    "eagle3_regen": ("eagle3_serve", ["trainer.epochs=null", "trainer.export_formats=[]"]),
    # The fair off-policy arm for long or sampled serving: the same recipe on answers regenerated afresh at the
    # evaluation's length and temperature (--fresh-tokens, --fresh-temperature, --fresh-prompts; its own cached store)
    "eagle3_fresh": ("eagle3_serve", ["trainer.epochs=null", "trainer.export_formats=[]"]),
    "draft_opd_eagle3": ("draft_opd", OPD_HEAD),
    "draft_opd_eagle3_no_replay": ("draft_opd", OPD_HEAD + ["objective.replay=false"]),
    "draft_opd_eagle3_no_weighting": ("draft_opd", OPD_HEAD + ["objective.weighting=none"]),
}
INIT_RECIPES = {"init": "kd", "init_eagle3": "eagle3"}  # whose draft group builds each untrained baseline
# the variants trained on the data alone (no rollouts)
OFF_POLICY_VARIANTS = ("kd", "eagle3", "eagle3_regen", "eagle3_fresh")
DEFAULT = ["init", "kd", "eagle3", "draft_opd", "draft_opd_no_replay", "draft_opd_no_weighting", "draft_opd_no_assist"]
# The head benchmark: every arm continues the same EAGLE-3 head (--override draft.path=<head>).
# No assist=false arm for a head: it cannot decode without the target's features (DraftOPDObjective.check_draft_kind).
HEAD_ARMS = ["eagle3_regen", "draft_opd_eagle3", "draft_opd_eagle3_no_replay", "draft_opd_eagle3_no_weighting"]
BUDGETS = ("steps", "target_tokens", "wall_time")


def parse_args(argv=None):
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--variants", nargs="+", default=DEFAULT, choices=sorted(VARIANTS) + ["head"],
                   help="'head': the EAGLE-3 head arms " + " ".join(HEAD_ARMS))
    a.add_argument("--target", default="embedded:smollm2-135m-instruct")
    a.add_argument("--data", default="embedded:sharegpt")
    a.add_argument("--max-rows", type=int, default=2000, help="data rows read")
    a.add_argument("--max-length", type=int, default=384, help="data.max_length (training conversations)")
    a.add_argument("--steps", type=int, default=40, help="optimizer steps (the budget, or draft_opd's share of it)")
    a.add_argument("--budget", choices=BUDGETS, default="steps")
    a.add_argument("--minutes", type=float, default=None, help="--budget wall_time: training minutes per variant")
    a.add_argument("--checkpoints-at", type=float, nargs="+", default=[1.0],
                   help="fractions of the budget at which each variant's run is scored (e.g. 0.5 1.0)")
    a.add_argument("--micro-batch-size", type=int, default=4)
    a.add_argument("--grad-accum", type=int, default=1)
    a.add_argument("--lr", type=float, default=None, help="null: each recipe's own")
    a.add_argument("--rollout-tokens", type=int, default=32, help="draft_opd objective.max_new_tokens")
    a.add_argument("--rollout-temperature", type=float, default=None,
                   help="draft_opd objective.temperature (null: the recipe's)")
    a.add_argument("--fresh-tokens", type=int, default=None,
                   help="eagle3_fresh: data.regenerate.max_new_tokens of its fresh store (needed by that variant)")
    a.add_argument("--fresh-temperature", type=float, default=1.0, help="eagle3_fresh: data.regenerate.temperature")
    a.add_argument("--fresh-prompts", type=int, default=None,
                   help="eagle3_fresh: data.regenerate.max_prompts (null: the recipe's)")
    a.add_argument("--opd-warm-start", default=None, help="draft.path of a standalone draft for the draft_opd variants")
    a.add_argument("--prompts", default="embedded:mt_bench")
    a.add_argument("--num-prompts", type=int, default=80)
    a.add_argument("--max-new-tokens", type=int, default=128, help="evaluation tokens per prompt")
    a.add_argument("--gamma", type=int, default=4)
    a.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    a.add_argument("--draft-policy", choices=("greedy", "sample"), default="greedy",
                   help="how drafts are proposed at T > 0 in scoring (greedy: argmax, one-hot; what vLLM does)")
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
    if "eagle3_fresh" in args.variants and (args.fresh_tokens is None or args.fresh_tokens < 1):
        a.error("variant eagle3_fresh regenerates its own answers: give their length with --fresh-tokens N (the "
                "evaluation's --max-new-tokens for the fair baseline)")
    if "head" in args.variants:
        args.variants = list(dict.fromkeys(v for x in args.variants for v in (HEAD_ARMS if x == "head" else [x])))
    if (args.budget == "wall_time") != (args.minutes is not None):
        a.error("--budget wall_time needs --minutes M (training minutes per variant), and --minutes needs it")
    if args.minutes is not None and args.minutes <= 0:
        a.error(f"--minutes must be > 0, got {args.minutes}")
    f = args.checkpoints_at
    if any(not 0 < x <= 1 for x in f) or sorted(set(f)) != f or f[-1] != 1.0:
        a.error(f"--checkpoints-at takes increasing fractions in (0, 1] ending at 1.0 (e.g. 0.5 1.0), got {f}")
    return args


def compose(recipe: str, overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specdistill.config import CONF_DIR, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=[f"recipe={recipe}"] + overrides)


def common_overrides(args, name: str, steps: int, save_every: int | None = None) -> list[str]:
    out = [f"target.path={args.target}", f"data.path={args.data}", f"data.max_rows={args.max_rows}",
           f"data.max_length={args.max_length}", f"trainer.max_steps={steps}", f"trainer.seed={args.seed}",
           f"trainer.micro_batch_size={args.micro_batch_size}", f"trainer.grad_accum={args.grad_accum}",
           f"trainer.output_dir={Path(args.out) / 'runs' / name}", f"trainer.save_every={save_every or steps}",
           "trainer.keep_checkpoints=0", "trainer.eval_every=0", f"trainer.log_every={max(1, min(5, steps))}",
           "trainer.warmup_steps=" + str(min(4, max(steps // 10, 0))), "eval.max_batches=2", "eval.spec_eval=false",
           f"run_name=bench_{name}"]
    if args.lr is not None:
        out.append(f"trainer.lr={args.lr}")
    return out + list(args.override)


def fresh_overrides(args, listed) -> list[str]:
    """eagle3_fresh's store: the recipe's prompts answered afresh at --fresh-tokens and --fresh-temperature, and a
    training length that keeps a whole answer (its prompt cap plus the answer)."""
    regen = listed.data.regenerate
    out = [f"data.regenerate.max_new_tokens={args.fresh_tokens}",
           f"data.regenerate.temperature={args.fresh_temperature}",
           f"data.max_length={max(args.max_length, regen.max_prompt_tokens + args.fresh_tokens)}"]
    if args.fresh_prompts is not None:
        out.append(f"data.regenerate.max_prompts={args.fresh_prompts}")
    return out


def data_target_tokens(c, steps: int) -> tuple[int, int]:
    """(target-forward tokens, loss tokens) of `steps` optimizer steps of an offline recipe: one target forward per
    micro-batch over its real tokens; the same micro-batches the loop reads."""
    from specdistill.data.loader import StepBatches

    t = c.trainer
    sb = StepBatches(c.data.train, t.micro_batch_size, t.grad_accum, c.models.tokenizer.pad_token_id, t.seed)
    fwd = loss = 0
    for s in range(steps):
        for b in sb.micro_batches(s):
            fwd += int(b["attention_mask"].sum())
            loss += int(b["loss_mask"].sum())
    return fwd, loss


def steps_for_target_tokens(c, budgets: list[int], cap: int) -> list[int]:
    """For each budget of target-forward tokens (increasing), the optimizer steps an offline recipe takes to run the
    target over that many tokens (its own micro-batches, in the loop's order), at most `cap`."""
    from specdistill.data.loader import StepBatches

    t = c.trainer
    sb = StepBatches(c.data.train, t.micro_batch_size, t.grad_accum, c.models.tokenizer.pad_token_id, t.seed)
    used, s, out = 0, 0, []
    for budget in budgets:
        while used < budget and s < cap:
            used += sum(int(b["attention_mask"].sum()) for b in sb.micro_batches(s))
            s += 1
        out.append(max(s, 1))
    return out


def checkpoint_steps(fractions: list[float], steps: int, quantum: int = 1) -> list[int]:
    """The steps at which a run of `steps` optimizer steps is scored: f x steps for each fraction, rounded to a
    multiple of `quantum` (fewer checkpoints to write), at least one step, the last one `steps`: one per fraction
    (two fractions of a short run can share a step)."""
    return [min(steps, max(quantum, round(f * steps / quantum) * quantum)) for f in fractions[:-1]] + [steps]


def _objective_target_tokens(checkpoint: Path) -> int:
    """An on-policy run's target-forward tokens up to a checkpoint: DraftOPDState.target_tokens_total in the
    objective's saved state (state/objective_0.pt; found at any depth, the state of one phase of many included)."""
    import torch

    def find(x):
        if isinstance(x, dict):
            if "target_tokens_total" in x:
                return int(x["target_tokens_total"])
            return next((v for v in map(find, x.values()) if v is not None), None)
        return None

    f = checkpoint / "state" / "objective_0.pt"
    got = find(torch.load(f, map_location="cpu", weights_only=False)) if f.exists() else None
    if got is None:
        raise ValueError(f"{f} holds no target_tokens_total: an on-policy checkpoint was expected")
    return got


def _point(c, recipe: str, checkpoint: Path, fraction: float) -> dict:
    """A scored budget point of a run: its checkpoint and what the run had spent up to it."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    step = int(state["step"])
    fwd = _objective_target_tokens(checkpoint) if recipe == "draft_opd" else data_target_tokens(c, step)[0]
    return {"fraction": fraction, "steps": step, "target_forward_tokens": fwd,
            "trained_positions": int(state.get("tokens_seen", 0)), "train_seconds": float(state.get("wall_s", 0.0)),
            "checkpoint": str(checkpoint)}


class BenchStopped(RuntimeError):
    """A variant's training was stopped by a signal: its budget was not spent, so nothing of it is scored."""


def _stop_if_preempted(res, name: str, run_dir: Path) -> None:
    """SIGTERM / SIGINT make the training loop checkpoint and return early (train/loop.py); a benchmark that went on
    would score a shorter run than its budget says (or, at wall time, resume it beside whatever sent the signal)."""
    if res.preempted:
        raise BenchStopped(f"{name}: its training was stopped by {res.preempted} at step {res.step}, before its budget "
                           f"was spent; the benchmark stops here. The variants scored before it are in results.json; "
                           f"run the rest again with --append --overwrite (its partial run is in {run_dir}).")


def train(args, name: str, steps: int, log=print, marks: list[int] | None = None) -> dict:
    """One variant's ONE run, and the budget points it is scored at: its checkpoints at the `marks` steps (step and
    target-token budgets), or (wall_time) at the --checkpoints-at fractions of --minutes, where the run stops at
    each fraction (trainer.max_minutes) and resumes exactly from its checkpoint (trainer.resume=auto)."""
    from specdistill.pipeline.run import build_components as build  # with the regeneration stage
    from specdistill.train.checkpoint import list_checkpoints
    from specdistill.train.loop import fit

    from specdistill.drafts import saved_kind

    recipe, extra = VARIANTS[name]
    listed = compose(recipe, common_overrides(args, name, steps) + extra)  # the variant as VARIANTS lists it
    kind = variant_kind(listed)
    if args.opd_warm_start and recipe == "draft_opd" and saved_kind(args.opd_warm_start) is kind:
        extra = extra + kind.warm_start_overrides(args.opd_warm_start)  # the variants of the saved draft's kind
    if recipe == "draft_opd":
        extra = extra + [f"objective.max_new_tokens={args.rollout_tokens}", f"objective.gamma={args.gamma}"]
        if args.rollout_temperature is not None:
            extra = extra + [f"objective.temperature={args.rollout_temperature}"]
    if name == "eagle3_fresh":
        extra = extra + fresh_overrides(args, listed)
    if "steps" in listed.objective:  # a training-time-test unroll (eagle3) covers the gamma drafts the eval makes
        extra = extra + [f"objective.steps={args.gamma}"]
    run_dir = Path(args.out) / "runs" / name
    if run_dir.exists():
        if not args.overwrite:
            raise FileExistsError(f"{run_dir} exists from an earlier benchmark: pass --overwrite or another --out")
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    if args.budget == "wall_time":  # one run, stopped at each fraction of the minutes and resumed
        cap_reached = False
        for k, f in enumerate(args.checkpoints_at):
            cfg = compose(recipe, common_overrides(args, name, steps) + extra + [
                f"trainer.max_minutes={f * args.minutes}"] + (["trainer.resume=auto"] if k else []))
            c = build(cfg)
            res = fit(c)
            _stop_if_preempted(res, name, run_dir)
            if res.step >= steps:
                cap_reached = True
                log(f"[bench] {name} reached the step cap --steps={steps} before {f * args.minutes:.2f} minutes: "
                    "raise --steps so that the wall clock is the budget")
                break
        by_step = {int(p.name.split("-")[1]): p for p in list_checkpoints(run_dir)}
        points = [_point(c, recipe, p, f) for f, p in zip(args.checkpoints_at, by_step.values())]
    else:
        marks = marks or [steps]
        g = math.gcd(*marks)
        cfg = compose(recipe, common_overrides(args, name, steps, save_every=g) + extra)
        c = build(cfg)
        res = fit(c)
        _stop_if_preempted(res, name, run_dir)
        by_step = {int(p.name.split("-")[1]): p for p in list_checkpoints(run_dir)}
        points = [_point(c, recipe, by_step[m], f) for m, f in zip(marks, args.checkpoints_at)]
        cap_reached = False
        for step, p in by_step.items():  # checkpoints that are no budget point: not kept
            if step not in marks:
                shutil.rmtree(p)
    seconds = time.perf_counter() - t0
    last = points[-1]
    log(f"[bench] {name}: {last['steps']} steps, {last['target_forward_tokens']} target-forward tokens, "
        f"{last['trained_positions']} trained positions, {last['train_seconds']:.1f} s training wall time "
        f"({seconds:.1f} s with building and resumes); scored at steps {[p['steps'] for p in points]}")
    return {"components": c, "steps": last["steps"], "target_forward_tokens": last["target_forward_tokens"],
            "trained_positions": last["trained_positions"], "train_seconds": last["train_seconds"],
            "checkpoint": last["checkpoint"], "points": points, "step_cap_reached": cap_reached,
            "config": run_config(cfg),
            "last_train_metrics": {k: v for k, v in res.history[-1].items() if k.startswith("train/")}
            if res.history else {}}


def reeval_recipe(args, name: str, run: dict) -> tuple[str, list[str]]:
    """(recipe, overrides) that build the models with a saved variant's final draft (init variants: as built)."""
    if name in INIT_RECIPES:
        return INIT_RECIPES[name], common_overrides(args, name + "_reeval", 1)
    recipe, extra = VARIANTS[name]
    kind = variant_kind(compose(recipe, common_overrides(args, name, 1) + extra))
    # The recipe named after the kind's data objective (kd / eagle3) builds it; its saved draft replaces the built one.
    return (kind.spec.data_objective,
            common_overrides(args, name + "_reeval", 1) + kind.warm_start_overrides(Path(run["checkpoint"]) / "draft"))


def load_checkpoint_draft(c, checkpoint: str):
    """The draft saved in a training checkpoint (its kind's adapter loads it), on the target's device, for scoring."""
    from specdistill.decoding.kv import device_of
    from specdistill.drafts import draft_adapter, load_trained_draft
    from specdistill.drafts.base import cast_for_decoding

    draft = load_trained_draft(Path(checkpoint) / "draft").to(device_of(c.models.target.model))
    draft_adapter(draft).check_target(c.models.target.model, "a scored draft must match the benchmark's target")
    return cast_for_decoding(draft, c.models.target.model).requires_grad_(False).eval()  # the target's dtype


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
                      draft_policy=args.draft_policy, measure_cost=not args.no_cost,
                      output_dir=str(Path(args.out) / "eval"))
    was = draft.training
    draft.eval()
    try:
        r = evaluate(target, c.models.tokenizer, draft, prompts, ecfg, progress=False, log=log)
    finally:
        draft.train(was)
    per_prompt = [[x["new_tokens"], x["target_forwards"]] for x in r.samples]
    keep = ("prompt", "category", "new_tokens", "target_forwards", "reached_per_pos", "accepted_per_pos",
            "output_buckets")  # acceptance by output position: scripts/compare_evals.py pairs it per bucket
    return {"mean_accept_len": r.mean_accept_len, "tau_ci95": tau_interval(per_prompt, args.seed),
            "per_prompt_tokens_forwards": per_prompt,
            "samples": [{k: x[k] for k in keep if k in x} for x in r.samples],
            "by_category": r.by_category, "eval_settings": eval_settings(args, temperature),
            "alpha": r.alpha, "speedup": r.speedup,
            "accept_rate_per_pos": r.accept_rate_per_pos, "tokens_per_s": r.tokens_per_s,
            "target_only_tokens_per_s": r.target_only_tokens_per_s, "greedy_mismatches": r.greedy_mismatches,
            "new_tokens": r.new_tokens, "predicted_speedup": r.predicted_speedup}


def eval_settings(args, temperature: float) -> dict:
    """The evaluator settings that make two scorings comparable (specdistill.eval.compare.COMPARABLE)."""
    return {"prompts": args.prompts, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
            "temperature": temperature, "gamma": args.gamma, "draft_policy": args.draft_policy}


def size_knobs(args) -> dict:
    """What makes two benchmark runs comparable (checked by --append and --merge)."""
    keys = ("target", "data", "max_rows", "max_length", "steps", "budget", "micro_batch_size", "grad_accum", "lr",
            "rollout_tokens", "rollout_temperature", "fresh_tokens", "fresh_temperature", "fresh_prompts",
            "opd_warm_start", "prompts", "num_prompts", "max_new_tokens", "gamma", "temperatures",
            "eval_batch_size", "minutes", "checkpoints_at", "draft_policy",
            "seed", "override")
    return {k: getattr(args, k) for k in keys}


def _points(r: dict) -> list[dict]:
    """A variant's scored budget points (an untrained baseline, or a run of an older benchmark: its one result)."""
    return r.get("points") or [{"fraction": 1.0, **{k: r.get(k, 0) for k in (
        "steps", "target_forward_tokens", "trained_positions", "train_seconds")}, "eval": r["eval"]}]


def compare_to_off_policy(args, results: dict) -> list[dict]:
    """Per budget point (k-th fraction) and temperature: every trained arm's tau against the best off-policy arm's
    there, overall and per category, with paired bootstrap intervals over prompts (specdistill.eval.compare)."""
    from specdistill.eval.compare import RunCounts, compare

    off = [n for n in OFF_POLICY_VARIANTS if n in results]
    trained = [n for n in results if n not in INIT_RECIPES]
    out = []
    if not off:
        return out
    for k, f in enumerate(args.checkpoints_at):
        for T in args.temperatures:
            key = f"T={T:g}"
            runs = {}
            for n in trained:
                pts = _points(results[n])
                e = pts[k]["eval"][key] if k < len(pts) else None
                if e is not None and e.get("samples"):
                    runs[n] = RunCounts.from_samples(n, e.get("eval_settings") or eval_settings(args, T), e["samples"])
            offs = [n for n in off if n in runs]
            if not offs or len(runs) < 2:
                continue
            best = max(offs, key=lambda n: _points(results[n])[k]["eval"][key]["mean_accept_len"])
            out.append({"fraction": f, "temperature": T, "baseline": best,
                        **compare(list(runs.values()), best, args.seed)})
    return out


def _budget_x(args, p: dict) -> float:
    """A budget point's position on the plot's x axis, in the budget's own unit."""
    if args.budget == "wall_time":
        return p["train_seconds"] / 60
    return p["target_forward_tokens"] if args.budget == "target_tokens" else p["steps"]


def write_outputs(args, results: dict, budget: dict, knobs: dict) -> dict[str, Path]:
    from specdistill.eval.compare import markdown as compare_markdown

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = sys.argv[1:] if getattr(args, "argv", None) is None else args.argv
    command = "python -m benchmarks.recipes " + shlex.join(argv)
    comparisons = compare_to_off_policy(args, results)
    meta = {"knobs": knobs, "budget": budget, "argv": argv, "command": command}
    (out / "results.json").write_text(json.dumps({"meta": meta, "variants": results, "comparisons": comparisons},
                                                 indent=1))
    temps = args.temperatures
    head = ["variant", "steps", "target-fwd tokens", "trained positions", "train s"]
    for T in temps:
        head += [f"tau T={T:g}", f"alpha T={T:g}", f"speedup T={T:g}"]
    lines = [f"# Recipes on {args.target}, MT-bench-style prompts ({args.prompts}, {args.num_prompts} prompts, "
             f"{args.max_new_tokens} new tokens), gamma {args.gamma}, draft policy {args.draft_policy}",
             "", f"Command: `{command}`", "", f"Budget: {budget['unit']} ({budget['description']}).", "",
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
    if len(args.checkpoints_at) > 1:
        lines += ["", "## tau against the budget (each variant's one run, scored at its checkpoints)", "",
                  "| variant | fraction | steps | target-fwd tokens | train s | " +
                  " | ".join(f"tau T={T:g}" for T in temps) + " |", "|---|---|---|---|---|" + "---|" * len(temps)]
        for name, r in results.items():
            for p in _points(r):
                taus = [f"{p['eval'][f'T={T:g}']['mean_accept_len']:.3f}" for T in temps]
                lines.append(f"| {name} | {p['fraction']:g} | {p['steps']} | {p['target_forward_tokens']} | "
                             f"{p['train_seconds']:.1f} | " + " | ".join(taus) + " |")
    for cmp in comparisons:  # each on-policy arm's tau against the best off-policy arm's, with its paired interval
        lines += [""] + compare_markdown(cmp, f"## At {cmp['fraction']:g} of the budget, T={cmp['temperature']:g}: "
                                              f"against the best off-policy arm ({cmp['baseline']})")
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

    unit = {"wall_time": "training minutes", "target_tokens": "target-forward tokens"}.get(args.budget, "steps")
    fig, axes = plt.subplots(1, len(temps), figsize=(4.5 * len(temps), 3.5), squeeze=False)
    for ax, T in zip(axes[0], temps):
        for n in names:
            pts = [p for p in _points(results[n]) if n not in INIT_RECIPES]
            if pts:
                ax.plot([_budget_x(args, p) for p in pts], [p["eval"][f"T={T:g}"]["mean_accept_len"] for p in pts],
                        "o-" if len(pts) > 1 else "o", label=n)
        ax.set(xlabel=unit, ylabel=f"tau, gamma {args.gamma}", title=f"T={T:g} ({args.draft_policy} drafts)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tau_vs_budget.png", dpi=120)
    plt.close(fig)
    return {"json": out / "results.json", "md": out / "results.md", "plot": out / "tau.png",
            "budget_plot": out / "tau_vs_budget.png"}


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.recipes`: run_bench with the command line."""
    try:
        run_bench(argv)
    except BenchStopped as e:
        raise SystemExit(f"[bench] {e}") from None


@dataclass
class BenchState:
    """What run_bench's steps share: the arguments, the results so far (written after every variant), the one prompt
    set every variant is scored on, and (--budget target_tokens) the on-policy reference whose target tokens are the
    other variants' budget."""
    args: argparse.Namespace
    knobs: dict                             # size_knobs(args): what makes two benchmark runs comparable
    log: Callable[[str], None] = print
    results: dict = field(default_factory=dict)  # variant -> its runs, budget points and scores
    prompts: Any = None                     # loaded at the first scoring
    reference: Optional[str] = None         # the first on-policy variant listed
    budget_tokens: Optional[int] = None     # its target-forward tokens, once known

    @property
    def previous(self) -> Path:
        return Path(self.args.out) / "results.json"


def run_bench(argv: list[str] | None = None) -> dict:
    """Train and evaluate every selected variant; returns {variant: results} (also written under --out)."""
    from specdistill.threads import configure_threads

    args = parse_args(argv)
    args.argv = list(argv) if argv is not None else None  # the command recorded in results.md
    configure_threads(args.threads, "--threads")
    b = BenchState(args, size_knobs(args))
    _keep_earlier_results(b)
    _choose_reference(b)
    if args.reeval:
        _reevaluate(b)
    todo = [v for v in args.variants if v not in b.results and (args.only is None or v in args.only)]
    _score_untrained(b, todo)
    for name in _training_order(b, todo):
        _train_and_score(b, name)
    paths = _save(b)
    b.log(f"[bench] wrote {', '.join(str(p) for p in paths.values())}")
    b.log(paths["md"].read_text())
    return {n: b.results[n] for n in args.variants if n in b.results}


def _keep_earlier_results(b: BenchState) -> None:
    """--append and --merge: the variants of earlier runs of the same benchmark are kept, not rerun."""
    args = b.args
    sources = [b.previous] if args.append and b.previous.exists() else []
    sources += [Path(d) / "results.json" for d in args.merge]
    for src in sources:
        if not src.exists():
            raise FileNotFoundError(f"--merge: {src} does not exist (a benchmark --out folder holds results.json)")
        old = json.loads(src.read_text())
        if old["meta"].get("knobs") != b.knobs:
            raise ValueError(f"{src} was made with other settings ({old['meta'].get('knobs')} vs {b.knobs}): only "
                             "runs of the same benchmark can share a table; use another --out")
        b.results.update({k: v for k, v in old["variants"].items() if k not in b.results})
        b.log(f"[bench] keeping {sorted(old['variants'])} from {src}")


def _choose_reference(b: BenchState) -> None:
    """--budget target_tokens: the first on-policy variant is the reference; its target tokens, when an earlier run
    measured them, are the budget."""
    on_policy = [v for v in b.args.variants if v in VARIANTS and VARIANTS[v] and VARIANTS[v][0] == "draft_opd"]
    b.reference = on_policy[0] if on_policy else None
    if b.args.budget == "target_tokens":
        b.budget_tokens = b.results.get(b.reference, {}).get("target_forward_tokens")


def _eval_all(b: BenchState, c, draft) -> dict:
    """A draft scored at every --temperatures on the benchmark's prompt set."""
    from specdistill.data.prompts import load_prompts
    from specdistill.decoding.kv import max_positions

    args = b.args
    if b.prompts is None:  # one prompt set for every variant
        b.prompts = load_prompts(args.prompts, c.models.tokenizer, num_prompts=args.num_prompts,
                                 max_new_tokens=args.max_new_tokens, context=max_positions(c.models.target.model))
    out = {f"T={T:g}": evaluate_draft(args, c, draft, b.prompts, T, b.log) for T in args.temperatures}
    for T in args.temperatures:
        e = out[f"T={T:g}"]
        b.log(f"[bench] T={T:g}: tau {e['mean_accept_len']:.3f}, alpha {e['alpha']:.3f}, speedup {e['speedup']:.3f}x")
    return out


def _budget(b: BenchState) -> dict:
    """The budget every variant got, as results.json and results.md record it."""
    args = b.args
    if args.budget == "steps":
        return {"unit": "optimizer steps", "steps": args.steps,
                "description": f"{args.steps} optimizer steps of {args.micro_batch_size} x {args.grad_accum} "
                               "conversations/prompts each, same data order; target-forward tokens recorded"}
    if args.budget == "wall_time":
        return {"unit": "training wall time", "minutes": args.minutes,
                "description": f"{args.minutes:g} minutes of training wall time per variant (trainer.max_minutes, "
                               f"step cap {args.steps}), variants one after another; steps and tokens recorded"}
    return {"unit": "target-forward tokens", "target_forward_tokens": b.budget_tokens,
            "description": f"{b.budget_tokens} tokens through the target ({b.reference}'s {args.steps} steps); "
                           "steps per variant recorded"}


def _save(b: BenchState) -> dict[str, Path]:
    """results.json, results.md and the plots, after every variant: an interrupted benchmark keeps what it measured."""
    return write_outputs(b.args, {n: b.results[n] for n in b.args.variants if n in b.results}, _budget(b), b.knobs)


def _reevaluate(b: BenchState) -> None:
    """--reeval: the --only variants scored again from their saved final drafts, no training."""
    from specdistill.pipeline.run import build_components as build

    args = b.args
    if not args.append or not args.only:
        raise ValueError("--reeval re-scores saved variants: pass --append and --only <variants>")
    for name in args.only:
        if name not in b.results:
            raise ValueError(f"--reeval: {name} is not in {b.previous}; run it first")
        c = build(compose(*reeval_recipe(args, name, b.results[name])))
        b.results[name]["eval"] = _eval_all(b, c, c.accelerator.unwrap_model(c.models.draft))
        del c
        _save(b)


def _score_untrained(b: BenchState, todo: list[str]) -> None:
    """The drafts the trained variants start from, scored untrained."""
    from specdistill.pipeline.run import build_components as build

    for name, recipe in INIT_RECIPES.items():
        if name in todo:
            c0 = build(compose(recipe, common_overrides(b.args, name, 1)))
            b.results[name] = {"steps": 0, "target_forward_tokens": 0, "trained_positions": 0, "train_seconds": 0.0,
                               "eval": _eval_all(b, c0, c0.accelerator.unwrap_model(c0.models.draft))}
            del c0
            _save(b)


def _training_order(b: BenchState, todo: list[str]) -> list[str]:
    """The variants to train; under --budget target_tokens the reference first (its tokens are the budget)."""
    order = [v for v in todo if v not in INIT_RECIPES]
    if b.args.budget == "target_tokens" and b.budget_tokens is None:
        if b.reference is None or b.reference not in order:
            raise ValueError("--budget target_tokens measures the budget on an on-policy variant (draft_opd or "
                             "draft_opd_eagle3 ...): include one; the first listed is the reference")
        order = [b.reference] + [v for v in order if v != b.reference]
    return order


def _train_and_score(b: BenchState, name: str) -> None:
    """One variant: its one run at its budget, scored at every budget point from that point's checkpoint."""
    from specdistill.pipeline.run import build_components as build

    args = b.args
    recipe, extra = VARIANTS[name]
    steps, marks = args.steps, checkpoint_steps(args.checkpoints_at, args.steps)
    if b.budget_tokens is not None and recipe != "draft_opd":  # the reference's target tokens at each point
        tokens = [p["target_forward_tokens"] for p in b.results[b.reference]["points"]]
        probe = build(compose(recipe, common_overrides(args, name + "_probe", 1) + extra))
        exact = steps_for_target_tokens(probe, tokens, cap=100 * args.steps)
        del probe  # on-policy variants keep the reference's steps (their target tokens per step are alike)
        steps = exact[-1]
        marks = checkpoint_steps([m / steps for m in exact], steps, quantum=max(1, exact[0] // 8))
    run = train(args, name, steps, b.log, marks=marks)
    if name == b.reference and args.budget == "target_tokens":
        b.budget_tokens = run["target_forward_tokens"]
    c = run.pop("components")
    for point in run["points"]:  # every budget point of the one run, scored from its checkpoint
        point["eval"] = _eval_all(b, c, load_checkpoint_draft(c, point["checkpoint"]))
    run["eval"] = run["points"][-1]["eval"]
    b.results[name] = run
    del c
    _save(b)


if __name__ == "__main__":
    main()
