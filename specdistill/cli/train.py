"""`specdistill-train recipe=<name> [overrides]`: compose the config (Hydra), build, fit (thin; the work is
pipeline.run).

Under accelerate: `accelerate launch train.py recipe=kd` (the repo's shim) or
`accelerate launch -m specdistill.cli.train recipe=kd`. Configs come from conf/ and recipes/:
the checkout's top level, or inside the installed package (specdistill.config.config_folder).
"""
import hydra
from omegaconf import DictConfig

from specdistill.config import CONF_DIR, register_configs


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _train(cfg: DictConfig) -> None:
    import torch.distributed as dist

    from specdistill.pipeline.run import run

    run(cfg)
    if dist.is_available() and dist.is_initialized():  # the group's threads end before the interpreter's teardown
        dist.destroy_process_group()


def main() -> None:
    register_configs()
    _train()


if __name__ == "__main__":
    main()
