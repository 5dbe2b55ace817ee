"""Benchmark the training recipes (shim over specdistill.cli.bench, also installed as `specdistill-bench`).

  python scripts/bench_recipes.py --steps 200 --micro-batch-size 8 --num-prompts 80 --max-new-tokens 128
"""
from specdistill.cli.bench import main

if __name__ == "__main__":
    main()
