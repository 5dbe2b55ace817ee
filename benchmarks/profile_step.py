"""Where a training step's time goes, on any recipe and device: the training loop's own profiler
(trainer.profile_steps) over a few optimizer steps after a warm-up and the FLOP-counted step (cached stages reused).

  python -m benchmarks.profile_step recipe=eagle3_serve --steps 3 --out outputs/profile_eagle3_serve

Hydra overrides as for train.py; --steps/--out are this script's own. The steps run exactly as train.py runs them
(the accelerator's device, mixed precision, accumulation). Writes <out>/run/profile.json and profile.md: the device's
time by kind of work (CUDA kernels on a GPU, the operators' own time on the CPU), the largest kernels or operators,
and MFU split into matmul kernel rate x matmul share x device busy fraction (specdistill/train/profile.py). Run it on
an idle machine.
"""
import argparse
import shlex
import shutil
import sys
from pathlib import Path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="profiled optimizer steps (after 2 unprofiled ones)")
    ap.add_argument("--out", default="outputs/profile")
    own, overrides = ap.parse_known_args(argv)
    if own.steps < 1:
        ap.error(f"--steps must be >= 1, got {own.steps}")

    from hydra import compose, initialize_config_dir

    from specdistill.config import CONF_DIR, register_configs
    from specdistill.pipeline.run import build_components
    from specdistill.train.loop import fit

    register_configs()
    run = Path(own.out) / "run"
    if run.exists():  # this script's own earlier run is replaced; any other folder is left alone
        if not (run / "profile.json").exists():
            sys.exit(f"{run} exists and holds no profile.json of this script: pass another --out")
        shutil.rmtree(run)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides + [
            f"trainer.output_dir={run}", f"trainer.profile_steps={own.steps}", f"trainer.max_steps={2 + own.steps}",
            "trainer.epochs=null", "trainer.log_every=1", "trainer.eval_every=0", "trainer.save_every=100000",
            "trainer.keep_checkpoints=1", "trainer.export_formats=[]", "eval.spec_eval=false"])
    fit(build_components(cfg))
    print(f"python -m benchmarks.profile_step {' '.join(shlex.quote(a) for a in argv)}\n")
    print((run / "profile.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
