"""`specdistill-evaluate [overrides]`: speculative decoding evaluation (thin Hydra entry; the work is eval.run).

  specdistill-evaluate eval.drafter=ngram eval.num_prompts=80 eval.max_new_tokens=128
  specdistill-evaluate eval.draft_path=outputs/kd/checkpoints/step-0000040/draft eval.compare_hf=true
  specdistill-evaluate eval.drafter=target eval.batch_sizes=[1,2,4] eval.sweep_prompts=16

Same Hydra groups as training (target/ draft/ data/ objective/ trainer/ eval/, recipe=...); writes results.json,
results.md, outputs.jsonl and PNG plots to eval.output_dir (default outputs/eval_<drafter>).
"""
import sys

import hydra
from omegaconf import DictConfig

from specdistill.config import CONF_DIR, register_configs


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _evaluate(cfg: DictConfig) -> None:
    from specdistill.eval.run import run

    run(cfg)


def main() -> None:
    from specdistill.validation import override_errors

    problems = override_errors(sys.argv[1:])  # Hydra's lexer error shows only a caret under the character
    if problems:
        sys.exit("bad override (nothing was started):\n  - " + "\n  - ".join(problems))
    register_configs()  # Hydra's run dir is the working directory (conf/config.yaml): eval.run creates the output
    _evaluate()


if __name__ == "__main__":
    main()
