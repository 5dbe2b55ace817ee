"""Speculative decoding evaluation (shim over specdistill.cli.evaluate, also installed as `specdistill-evaluate`).

  python scripts/evaluate.py eval.drafter=ngram eval.num_prompts=80 eval.max_new_tokens=128
"""
from specdistill.cli.evaluate import main

if __name__ == "__main__":
    main()
