"""Expert-selective vs dense draft of equal parameter count on an MoE target, trained on the same budget.

  python scripts/bench_moe.py                                  # small: the upcycled SmolLM2 MoE, one core, < 10 min
  python scripts/bench_moe.py trainer.max_steps=200 data.max_length=512 eval.num_prompts=20   # bigger

Same Hydra groups as train.py, composed as `recipe=moe_kd target=smollm2_moe` + the small defaults below + your
overrides. Steps: (1) profile the target's routing on the training data (profile.json, heatmap.png); (2) for each
arm, build through specdistill.build and train with the same loop, steps, batches (same seed, same order) and
objective (moe_kd: KD + expert-level loss):
  moe:   the target's first draft.num_layers layers keeping their draft.moe.num_experts hot experts (sliced router,
         top-k = min(target top-k, kept));
  dense: the same layers, each MLP the concat-merge of the same hot experts (intermediate k*I, down_proj scaled by
         routing mass): the same parameter count up to the router rows;
(3) score both: simulated acceptance on held-out data (teacher-forced, before and after training) and the real
speculative evaluator (KV-cached, greedy) on MT-bench prompts. Writes bench.json and bench.md to --out.
"""
import json
import sys
import time
from pathlib import Path

# Sized for <= 10 minutes on one (shared) CPU core: the MoE target's forward dominates (~3-6 s per 2 x 128 tokens).
SMALL = ["data.max_rows=300", "data.max_length=128", "data.heldout_size=16", "trainer.max_steps=8",
         "trainer.micro_batch_size=2", "trainer.grad_accum=1", "trainer.warmup_steps=1", "trainer.lr=3e-3",
         "trainer.log_every=2", "trainer.eval_every=0", "trainer.save_every=1000", "draft.num_layers=2",
         "draft.moe.num_experts=3", "draft.moe.coverage=null", "draft.moe.profile_batches=4", "eval.gamma=4",
         "eval.max_batches=2", "eval.spec_eval=true", "eval.prompts=embedded:mt_bench", "eval.num_prompts=2",
         "eval.max_new_tokens=24", "eval.warmup_prompts=0", "eval.measure_cost=true"]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specdistill.config import CONF_DIR, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def bench(overrides: list[str], out: Path) -> dict:
    import torch
    from omegaconf import OmegaConf

    from specdistill.build import build, build_target, build_tokenizer
    from specdistill.data.dataset import build_data
    from specdistill.train.spec_eval import spec_eval_hook
    from specdistill.moe.build import draft_param_count
    from specdistill.moe.profiler import calibration_batches, plot_heatmap, profile_routing
    from specdistill.moe.upcycle import ensure_default_target
    from specdistill.train.loop import fit

    t0 = time.perf_counter()
    base = ["recipe=moe_kd", "target=smollm2_moe", "run_name=bench_moe"] + SMALL + list(overrides)
    cfg = compose(base)
    ensure_default_target(cfg.target.path)
    out.mkdir(parents=True, exist_ok=True)

    # (1) routing profile on the training data, once for both arms
    target, tok = build_target(cfg), build_tokenizer(cfg)
    data = build_data(OmegaConf.to_object(cfg.data), tok)
    m = cfg.draft.moe
    prof = profile_routing(target.model, calibration_batches(data.train, tok.pad_token_id, m.profile_batches),
                           m.token_selection, source={"target": str(cfg.target.path), "data": str(cfg.data.path)})
    prof_path = prof.save(out / "profile.json", coverage=0.9)
    plot_heatmap(prof, out / "heatmap.png", coverage=0.9)
    del target
    print(f"[bench] profile: {prof.tokens} tokens, {time.perf_counter() - t0:.0f}s", flush=True)

    # (2) + (3) both arms, same budget
    arms = {}
    for kind in ("moe", "dense"):
        ta = time.perf_counter()
        acfg = compose(base + [f"draft.moe.kind={kind}", f"draft.moe.profile={prof_path}",
                               f"trainer.output_dir={out / kind}"])
        torch.manual_seed(0)
        c = build(acfg)
        draft = c.accelerator.unwrap_model(c.models.draft)
        meta = dict(draft.config.specdistill_moe)
        res = fit(c, epoch_end_hooks=(spec_eval_hook,))
        last = res.history[-1]
        spec = json.loads((res.final_checkpoint / "metrics.json").read_text())
        arms[kind] = {
            "params": draft_param_count(draft),
            "draft_layers": meta["source_layers"], "experts": meta["experts"], "coverage": meta.get("coverage"),
            "top_k": draft.config.num_experts_per_tok,
            "mlp_intermediate": draft.model.layers[0].mlp.experts.gate_up_proj.shape[1] // 2,
            "steps": res.step, "loss_tokens": int(last["tokens_seen"]),
            "train_loss_first": res.history[0]["train/loss"], "train_loss_last": last["train/loss"],
            "train_expert_last": last.get("train/expert"), "train_kd_last": last.get("train/kd"),
            "tau_sim_before": res.heldout_before["heldout/mean_accept_len"],
            "tau_sim_after": res.heldout_after["heldout/mean_accept_len"],
            "top1_before": res.heldout_before["heldout/top1_agreement"],
            "top1_after": res.heldout_after["heldout/top1_agreement"],
            "tau_real": spec.get("spec/mean_accept_len"), "alpha_real": spec.get("spec/alpha"),
            "accept_rate_per_pos_real": [spec.get(f"spec/accept_rate_pos{k + 1}") for k in range(cfg.eval.gamma)],
            "cost_c": spec.get("spec/cost_c"), "speedup_real": spec.get("spec/speedup"),
            "greedy_mismatches": spec.get("spec/greedy_mismatches"),
            "seconds": round(time.perf_counter() - ta),
        }
        print(f"[bench] {kind}: {json.dumps(arms[kind])}", flush=True)
        del c, draft

    result = {"config": {"overrides": base[3:], "target": str(cfg.target.path), "eval_prompts": cfg.eval.prompts,
                         "num_prompts": cfg.eval.num_prompts, "max_new_tokens": cfg.eval.max_new_tokens,
                         "gamma": cfg.eval.gamma},
              "profile_summary": prof.summary(0.9), "arms": arms, "seconds": round(time.perf_counter() - t0)}
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.md").write_text(markdown(result))
    print(markdown(result))
    return result


def markdown(r: dict) -> str:
    rows = [("params", "params"), ("MLP intermediate", "mlp_intermediate"), ("draft top-k", "top_k"),
            ("experts kept", "experts"), ("routing coverage", "coverage"), ("steps", "steps"),
            ("loss tokens", "loss_tokens"), ("train loss first -> last", None), ("tau_sim before", "tau_sim_before"),
            ("tau_sim after", "tau_sim_after"), ("top-1 agreement after", "top1_after"), ("tau (real, MT-bench)", "tau_real"),
            ("alpha (real)", "alpha_real"), ("draft/target cost c", "cost_c"), ("speedup (real, CPU)", "speedup_real"),
            ("greedy mismatches", "greedy_mismatches"), ("seconds", "seconds")]
    a = r["arms"]
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| | expert-selective MoE draft | dense merged draft |", "|---|---|---|"]
    for label, key in rows:
        if key is None:
            vals = [f"{a[k]['train_loss_first']:.4f} -> {a[k]['train_loss_last']:.4f}" for k in ("moe", "dense")]
        else:
            vals = [fmt(a[k][key]) for k in ("moe", "dense")]
        lines.append(f"| {label} | {vals[0]} | {vals[1]} |")
    return "\n".join(lines) + f"\n\nTotal {r['seconds']} s. Config: {' '.join(r['config']['overrides'])}\n"


def main(argv=None) -> None:
    from specdistill.threads import configure_threads

    configure_threads(None, "trainer.threads")  # physical cores / local processes, printed
    args = list(sys.argv[1:] if argv is None else argv)
    out = Path("outputs/bench_moe")
    for a in list(args):
        if a.startswith("--out="):
            out = Path(a.split("=", 1)[1])
            args.remove(a)
    bench(args, out)


if __name__ == "__main__":
    main()
