"""Routing profile of an MoE target on calibration data: per layer and expert, token counts and routing-weight mass,
the hot experts per layer and the share of routing weight they cover. Same Hydra groups as train.py.

  python scripts/profile_moe.py target=smollm2_moe draft=moe_experts draft.moe.profile=outputs/profile_moe/profile.json
  python train.py recipe=moe_kd target=smollm2_moe draft.moe.profile=outputs/profile_moe/profile.json

Reads draft.moe: profile (where to write the JSON; null = outputs/profile_moe/profile.json), profile_batches
(batches of 4 training rows), token_selection (loss_mask | all) and coverage (hot-expert threshold for the
summary and heatmap). Writes profile.json and heatmap.png side by side.
"""
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specdistill.config import CONF_DIR, Config, register_configs

DEFAULT_OUT = "outputs/profile_moe/profile.json"


def profile(cfg: Config) -> Path:
    import torch

    from specdistill.build import build_target, build_tokenizer
    from specdistill.data.dataset import build_data
    from specdistill.moe.profiler import calibration_batches, plot_heatmap, profile_routing
    from specdistill.moe.upcycle import ensure_default_target

    m = cfg.draft.moe
    ensure_default_target(cfg.target.path)
    target = build_target(cfg.target)
    tok = build_tokenizer(cfg)
    data = build_data(cfg.data, tok)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = target.model.to(device)
    batches = calibration_batches(data.train, tok.pad_token_id, m.profile_batches)
    prof = profile_routing(model, batches, m.token_selection,
                           source={"target": str(cfg.target.path), "data": str(cfg.data.path),
                                   "rows": sum(len(b["input_ids"]) for b in batches), "fingerprint": data.fingerprint})
    coverage = m.coverage if m.coverage is not None else 0.9
    out = Path(m.profile or DEFAULT_OUT).expanduser()
    prof.save(out, coverage)
    png = plot_heatmap(prof, out.with_name("heatmap.png"), coverage)
    print(f"[profile_moe] {prof.model_type}: {len(prof.layers)} MoE layers x {prof.num_experts} experts, "
          f"top-{prof.top_k}, {prof.tokens} {prof.token_selection} tokens")
    print(f"{'layer':>5} {'hot experts (to ' + format(coverage, '.0%') + ')':<28} {'coverage':>8} {'top1 share':>10} "
          f"{'counts':<30}")
    for s in prof.summary(coverage):
        r = prof.row(s["layer"])
        print(f"{s['layer']:>5} {str(s['hot_experts']):<28} {s['coverage']:>8.3f} {s['top1_share']:>10.3f} "
              f"{str(prof.counts[r]):<30}")
    print(f"[profile_moe] wrote {out} and {png}")
    return out


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(composed: DictConfig) -> None:
    from specdistill.threads import configure_threads
    from specdistill.entry import load_config

    cfg = load_config(composed)  # checked and typed once: before any model loads
    configure_threads(cfg.trainer.threads, "trainer.threads")
    profile(cfg)


if __name__ == "__main__":
    register_configs()
    main()
