"""scripts/bench_moe.py: the MoE expert-selection comparison (specdistill/pipeline/moe_bench.py) from the command line.

  python scripts/bench_moe.py                                   # all arms, small budget, target=smollm2_moefied
  python scripts/bench_moe.py --arms=hot,random,cold trainer.max_steps=40 --spread-prompts=16
  python scripts/bench_moe.py --out=outputs/bench_moe_e8 target.path=/models/Qwen3-30B-A3B

Options (--name=value) are the bench's own; everything else is a Hydra override applied to every arm (as train.py).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def main(argv=None) -> dict:
    from specdistill.cli.bench import compose
    from specdistill.pipeline.moe_bench import arms, bench
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
    command = "python scripts/bench_moe.py " + " ".join(shlex.quote(a) for a in argv)
    return bench(overrides, Path(args.out), [a for a in args.arms.split(",") if a], args.eagle3_experts,
                 args.random_seed, command=command.strip(), compose=compose, spread_prompts=args.spread_prompts)


if __name__ == "__main__":
    main()
