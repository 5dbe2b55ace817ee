"""Train a draft model: `accelerate launch train.py recipe=<name> [overrides]` (or `python train.py ...`)."""
import hydra
from omegaconf import DictConfig

from specdistill.config import register_configs


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from specdistill.pipeline.run import run

    run(cfg)


if __name__ == "__main__":
    register_configs()
    main()
