"""Speculative decoding evaluation (thin Hydra entry; the work is specdistill.eval.run).

  python scripts/evaluate.py eval.drafter=ngram eval.num_prompts=80 eval.max_new_tokens=128
  python scripts/evaluate.py eval.draft_path=outputs/kd/checkpoints/step-0000040/draft eval.compare_hf=true
  python scripts/evaluate.py eval.drafter=target eval.batch_sizes=[1,2,4] eval.sweep_prompts=16

Same Hydra groups as train.py (target/ draft/ data/ objective/ trainer/ eval/, recipe=...); writes results.json,
results.md, outputs.jsonl and PNG plots to eval.output_dir (default outputs/eval_<drafter>).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from specdistill.config import register_configs  # noqa: E402


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from specdistill.eval.run import run

    run(cfg)


if __name__ == "__main__":
    register_configs()
    # Hydra's run dir is trainer.output_dir for training; an evaluation's belongs to eval.output_dir.
    if not any(a.startswith(("hydra.run.dir", "+hydra.run.dir")) for a in sys.argv[1:]):
        sys.argv.append("hydra.run.dir=${eval.output_dir}")
    main()
