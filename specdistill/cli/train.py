"""`specdistill-train recipe=<name> [overrides]`: compose the config (Hydra), build, fit (thin; the work is
pipeline.run).

Under accelerate: `accelerate launch train.py recipe=kd` (the repo's shim) or
`accelerate launch -m specdistill.cli.train recipe=kd`. Configs come from conf/ and recipes/:
the checkout's top level, or inside the installed package (specdistill.config.config_folder).
"""
import os
import socket
import sys
from typing import Callable
from urllib.parse import urlparse

import hydra
from omegaconf import DictConfig

from specdistill.config import CONF_DIR, register_configs

WANDB_PROBE_S = 5.0  # how long the W&B server may take to accept a connection before the run logs offline


def wandb_reachable(timeout_s: float = WANDB_PROBE_S) -> bool:
    """Whether the W&B server (WANDB_BASE_URL, else api.wandb.ai) accepts a TCP connection within timeout_s."""
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "api.wandb.ai", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wandb_offline_without_network(cfg: DictConfig, log: Callable[[str], None] = print,
                                  reachable: Callable[[], bool] = wandb_reachable) -> bool:
    """trainer.wandb_mode=online on a machine that cannot reach W&B: wandb.init would wait minutes and then fail
    the run. The run logs offline instead (synced later with `wandb sync`), said here. True when it switched."""
    t = cfg.trainer
    if not (t.wandb and t.wandb_mode == "online") or reachable():
        return False
    log(f"[train] warning: trainer.wandb_mode=online but the W&B server does not answer within {WANDB_PROBE_S:g} s "
        f"(no network, or WANDB_BASE_URL): logging offline into {t.output_dir}/wandb instead; upload it later with "
        f"`wandb sync {t.output_dir}/wandb/offline-run-*`, or pass trainer.wandb_mode=offline to skip this check")
    t.wandb_mode = "offline"
    os.environ["WANDB_MODE"] = "offline"
    return True


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _train(cfg: DictConfig) -> None:
    from specdistill.validation import validate_config

    validate_config(cfg, log=None)  # before the wandb probe; the pipeline checks again and prints the warnings
    wandb_offline_without_network(cfg)
    import torch.distributed as dist

    from specdistill.pipeline.run import run

    run(cfg)
    if dist.is_available() and dist.is_initialized():  # the group's threads end before the interpreter's teardown
        dist.destroy_process_group()


def main() -> None:
    from specdistill.validation import override_errors

    problems = override_errors(sys.argv[1:])  # Hydra's lexer error shows only a caret under the character
    if problems:
        sys.exit("bad override (nothing was started):\n  - " + "\n  - ".join(problems))
    register_configs()
    _train()


if __name__ == "__main__":
    main()
