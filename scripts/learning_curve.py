"""Learning curve of a training run: real speculative tau of every kept checkpoint (specdistill.pipeline.curve).

  python scripts/learning_curve.py --run outputs/eagle3_serve --num-prompts 20 --max-new-tokens 64 --gamma 4
  python scripts/learning_curve.py --run outputs/eagle3_serve --last --temperature 1 --out outputs/tau_t1   # final only
  python scripts/learning_curve.py --merge outputs/eagle3_serve/curve outputs/other/curve --out outputs/curves
  python scripts/learning_curve.py --run outputs/eagle3_serve --steps 288,576 --out outputs/tau_288_576
  python scripts/compare_evals.py outputs/tau_288_576@576 outputs/other/curve@588 --baseline outputs/other/curve@588

Writes <run>/curve/curve.json, curve.md, curve.png (tau against training tokens and wall minutes); --merge draws
several runs' curves on one plot. Each point keeps per-prompt counts, so points of two curves on the same prompts
compare paired (scripts/compare_evals.py CURVE_DIR@STEP).
"""
import argparse
import json
import shlex
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help="a training output dir (with checkpoints/ and config.yaml)")
    ap.add_argument("--target", default=None, help="default: the run's target.path")
    ap.add_argument("--prompts", default="embedded:mt_bench")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: physical cores)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--last", action="store_true", help="only the newest checkpoint (tau of the final draft)")
    ap.add_argument("--steps", default=None, help="only these checkpoints, e.g. 576,792")
    ap.add_argument("--out", default=None, help="default: <run>/curve")
    ap.add_argument("--merge", nargs="+", default=None, help="curve dirs to draw together (with --out)")
    ap.add_argument("--heldout", action="store_true",
                    help="no decoding: the run's in-training held-out proxy (metrics.jsonl) as the curve")
    a = ap.parse_args(argv)
    command = "python scripts/learning_curve.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))

    import torch

    from specdistill.pipeline.curve import CurvePoint, learning_curve, plot_curves, write_curve

    from specdistill.threads import configure_threads

    configure_threads(a.threads, "--threads")
    if a.merge:
        if not a.out:
            ap.error("--merge needs --out")
        curves = {}
        for d in a.merge:
            data = json.loads((Path(d) / "curve.json").read_text())
            curves[data.get("label") or d] = [CurvePoint(**p) for p in data["points"]]
        Path(a.out).mkdir(parents=True, exist_ok=True)
        plot_curves(curves, Path(a.out) / "curves.png")
        print(f"wrote {Path(a.out) / 'curves.png'}")
        return 0
    if not a.run:
        ap.error("--run is required (or --merge)")
    if a.heldout:
        from omegaconf import OmegaConf

        from specdistill.pipeline.curve import heldout_curve

        run = Path(a.run)
        label = a.label or f"{OmegaConf.load(run / 'config.yaml').run_name} (held-out proxy)"
        out = write_curve(heldout_curve(run), a.out or run / "curve_heldout", command, label=label,
                          extra={"source": "metrics.jsonl heldout/mean_accept_len"})
        print(f"wrote {out}/curve.json, curve.md, curve.png")
        return 0
    from omegaconf import OmegaConf

    from specdistill.data.prompts import load_prompts
    from specdistill.models.target import load_causal_lm, load_tokenizer
    from specdistill.decoding.kv import max_positions

    run = Path(a.run)
    cfg = OmegaConf.load(run / "config.yaml")
    target_path = a.target or cfg.target.path
    model = load_causal_lm(target_path, "float32").eval()
    tok = load_tokenizer(target_path)
    ps = load_prompts(a.prompts, tok, num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens,
                      context=max_positions(model), max_prompt_tokens=1024)
    pts = learning_curve(run, model, tok, ps.ids, gamma=a.gamma, max_new_tokens=a.max_new_tokens,
                         temperature=a.temperature, last_only=a.last, categories=ps.categories,
                         steps=[int(x) for x in a.steps.split(",")] if a.steps else None)
    out = write_curve(pts, a.out or run / "curve", command, label=a.label or cfg.run_name,
                      extra={"prompts": a.prompts, "num_prompts": len(ps.ids), "gamma": a.gamma,
                             "max_new_tokens": a.max_new_tokens, "temperature": a.temperature,
                             "threads": torch.get_num_threads()})
    print(f"wrote {out}/curve.json, curve.md, curve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
