"""How long a training step of the stored-feature path waits for its data, with and without prefetch, at a target's
width, on CPU.

It writes a feature store of random bf16 features at that width (data/features.py: aux (T, 3 x hidden) and final
(T, hidden) per example, what an 8B target stores), then runs the loop's data path over it: StepBatches over
WithFeatures (memory-mapped reads, collate) served through data.loader.Prefetcher, and the loop's host-to-device
call. A step's compute is simulated by a sleep of --compute-s seconds: on a GPU the Python thread mostly waits for
the device while the head computes, which a sleep reproduces; the compute itself is not run (an 8B-width head step
on 2 CPU cores would take minutes). --compute-s auto sets it to the measured load time of one step, the case the
stored-feature path is in at 8B width: loading a step takes about as long as the head's compute.

    python -m benchmarks.prefetch                          # 8B width (hidden 4096), T=512, 4 x 2 per step
    python -m benchmarks.prefetch --hidden 2048 --compute-s 0.2

Prints, per mode (no prefetch / prefetch depth d), seconds per step and the fraction of the step spent waiting for
data (Prefetcher.wait_s over wall time), and writes them as JSON with --json.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--hidden", type=int, default=4096, help="target hidden size (Llama-3-8B: 4096)")
    a.add_argument("--aux-layers", type=int, default=3, help="aux hidden states stored per token (EAGLE-3: 3)")
    a.add_argument("--tokens", type=int, default=512, help="mean tokens per example (lengths vary +-50%%)")
    a.add_argument("--micro-batch-size", type=int, default=4)
    a.add_argument("--grad-accum", type=int, default=2)
    a.add_argument("--steps", type=int, default=10, help="timed steps per mode (after one warm-up step)")
    a.add_argument("--depth", type=int, default=2, help="prefetch depth (trainer.prefetch_steps)")
    a.add_argument("--compute-s", default="auto", help="simulated compute per step in seconds, or auto (= load time)")
    a.add_argument("--dir", default=None, help="where the feature store is written (default: a temporary folder)")
    a.add_argument("--json", default=None, help="also write the results here")
    a.add_argument("--seed", type=int, default=0)
    return a.parse_args(argv)


def write_store(root: Path, n: int, hidden: int, aux_layers: int, tokens: int, seed: int) -> list[int]:
    """A feature store of n examples with random bf16 features; returns their lengths."""
    import torch

    from specdistill.data.features import FeatureWriter

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = [rng.randint(tokens // 2, tokens * 3 // 2) for _ in range(n)]
    w = FeatureWriter(root, meta={"hidden": hidden}, shard_mb=256)
    for T in lengths:
        w.add(torch.randn(T, aux_layers * hidden, generator=g), torch.randn(T, hidden, generator=g))
    w.close()
    return lengths


def run_mode(batches, depth: int, steps: int, compute_s: float) -> dict:
    """`steps` timed steps after one warm-up step: seconds per step and the fraction spent waiting for data."""
    import torch

    from specdistill.data.loader import Prefetcher

    device = torch.device("cpu")
    with Prefetcher(batches.micro_batches, 0, steps + 1, depth=depth) as pf:
        for step in range(steps + 1):
            if step == 1:  # the clock starts after the warm-up step (first page faults, thread start)
                t0, wait0 = time.perf_counter(), pf.wait_s
            micro = [{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in pf.get(step)]
            assert micro[0]["aux_hidden"].dtype == torch.bfloat16
            time.sleep(compute_s)
        wall, wait = time.perf_counter() - t0, pf.wait_s - wait0
    return {"depth": depth, "s_per_step": wall / steps, "wait_s_per_step": wait / steps, "wait_fraction": wait / wall}


def main(argv=None) -> dict:
    import torch

    from specdistill.data.features import FeatureStore, WithFeatures
    from specdistill.data.loader import StepBatches

    args = parse_args(argv)
    per_step = args.micro_batch_size * args.grad_accum
    n = per_step * (args.steps + 1)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="prefetch_bench_"))
    store_dir = root / "features"
    shutil.rmtree(store_dir, ignore_errors=True)
    lengths = write_store(store_dir, n, args.hidden, args.aux_layers, args.tokens, args.seed)
    rows = [{"input_ids": [1] * T, "loss_mask": [1] * T} for T in lengths]
    data = WithFeatures(rows, FeatureStore(store_dir))
    batches = StepBatches(data, args.micro_batch_size, args.grad_accum, pad_id=0, seed=args.seed)
    step_bytes = sum(b["aux_hidden"].numel() * 2 + b["final_hidden"].numel() * 2 for b in batches.micro_batches(0))

    load = run_mode(batches, 0, args.steps, 0.0)  # load only: what each step costs without prefetch
    compute_s = load["s_per_step"] if args.compute_s == "auto" else float(args.compute_s)
    modes = [run_mode(batches, 0, args.steps, compute_s), run_mode(batches, args.depth, args.steps, compute_s)]
    out = {"hidden": args.hidden, "aux_dim": args.aux_layers * args.hidden, "mean_tokens": sum(lengths) / n,
           "micro_batch_size": args.micro_batch_size, "grad_accum": args.grad_accum,
           "collated_mb_per_step": step_bytes / 2**20, "load_s_per_step": load["s_per_step"],
           "compute_s_per_step": compute_s, "torch_threads": torch.get_num_threads(), "modes": modes}
    print(f"features at width {args.hidden} (aux {args.aux_layers} x {args.hidden}, bf16), {out['mean_tokens']:.0f} "
          f"tokens per example, {args.micro_batch_size} x {args.grad_accum} per step: "
          f"{out['collated_mb_per_step']:.0f} MB collated per step, loading it takes {load['s_per_step']:.3f} s")
    print(f"simulated compute per step: {compute_s:.3f} s")
    for m in modes:
        name = "no prefetch" if m["depth"] == 0 else f"prefetch depth {m['depth']}"
        print(f"  {name:<18} {m['s_per_step']:.3f} s/step, waiting for data {m['wait_s_per_step']:.3f} s/step "
              f"= {100 * m['wait_fraction']:.1f}% of the step")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
