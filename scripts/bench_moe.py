"""The MoE expert-selection comparison: hot / dense(hot) / random / cold drafts and an EAGLE-3 head from hot
experts vs a plain one, equal parameters and budget, scored before and after training (simulated tau and the real
evaluator, paired bootstrap intervals). Shim over specdistill.cli.bench_moe; the arms are in
specdistill/pipeline/moe_bench.py.

  python scripts/bench_moe.py                          # target=smollm2_moefied (make it: python scripts/moefy.py)
  python scripts/bench_moe.py --arms=hot,random,cold trainer.max_steps=40 eval.num_prompts=20 --out=outputs/b40
"""
from specdistill.cli.bench_moe import main

if __name__ == "__main__":
    main()
