"""Compare evaluator runs of several drafts on the same prompts (shim over specdistill.cli.compare_evals, also
installed as `specdistill-compare`): tau, paired bootstrap ratios to a baseline, overall and per category.

  python scripts/compare_evals.py outputs/eval_kd outputs/eval_opd --baseline outputs/eval_kd --out outputs/cmp
"""
from specdistill.cli.compare_evals import main

if __name__ == "__main__":
    main()
