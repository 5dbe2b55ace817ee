"""Train a draft model (shim over specdistill.cli.train, also installed as `specdistill-train`).

  accelerate launch train.py recipe=<name> [overrides]        (or python train.py ..., or specdistill-train ...)
"""
from specdistill.cli.train import main

if __name__ == "__main__":
    main()
