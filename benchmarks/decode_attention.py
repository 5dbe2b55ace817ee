"""One decode step's attention at a decoding shape, per attention implementation: where a large batch's time goes.

On the H200, batch-128 target-only decoding of an 8B-shaped target reached 25% of its bandwidth floor, its attention
kernels taking about 230 microseconds a layer where reading the keys and values once takes about 60. This times the
attention call alone at that shape, per implementation, so one run on a GPU says which to use:

  grouped   specdistill.models.attention (sdpa_grouped): query heads folded into their key/value head's rows, a bool
            mask over every cache column (what compiled decode steps run)
  repeat    transformers' sdpa: keys and values repeated per query head, the same mask
  gqa       F.scaled_dot_product_attention(enable_gqa=True), the same mask
  flex      torch.nn.attention.flex_attention with the mask as a block mask (GQA), compiled: its decoding kernel
            splits the keys across the GPU where one query row per head leaves SDPA's kernels few blocks
  unmasked  SDPA over the used columns only, no mask at all (holes and later queries' columns attended too: not the
            same attention, so its difference is not zero; the lower bound of a call's time)

Shapes: --batch rows, --queries query tokens each (1: a decode step; gamma + 1: a verify step), --heads query heads
over --kv-heads, --head-dim, a static cache of --columns columns of which the first --used are real (plus a few
holes), as compiled steps attend. Per variant: microseconds per call (CUDA events on CUDA, median of --iters after
warm-up), the bytes a call must read (every key and value it attends to), the rate against --bandwidth, and the
largest difference from the grouped output (they compute the same attention). --compile wraps each call in
torch.compile as inside the decode step's graph (flex always is). Imports torch only.

  python -m benchmarks.decode_attention --batch 128 --columns 512 --used 192 --compile --out attention.json
  python -m benchmarks.decode_attention --device cpu --batch 2 --heads 4 --kv-heads 2 --head-dim 16 --columns 64 \\
      --used 40 --iters 3      # the script's own check
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

VARIANTS = ("grouped", "repeat", "gqa", "flex", "unmasked")


@dataclass
class Timing:
    variant: str
    us_per_call: float
    bytes_read: float      # keys and values of the columns the call attends to
    fraction: float        # (bytes_read / bandwidth) / time: the share of the bandwidth the call reaches
    max_abs_diff: float    # against the grouped variant's output (0 for it)


def inputs(args, torch):
    """q (B, H, Q, D), k / v (B, Hkv, L, D), seen (B, L) bool (the first `used` columns but a few holes),
    write_at ()."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, Q, D, L = args.batch, args.heads, args.kv_heads, args.queries, args.head_dim, args.columns
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    q = torch.randn(B, H, Q, D, generator=g).to(args.device, dtype)
    k = torch.randn(B, Hkv, L, D, generator=g).to(args.device, dtype)
    v = torch.randn(B, Hkv, L, D, generator=g).to(args.device, dtype)
    seen = torch.arange(L)[None].expand(B, -1) < args.used
    seen = seen & (torch.rand(B, L, generator=g) > 0.05)       # holes: rejected drafts
    seen[:, args.used - Q: args.used] = True                  # the queries' own columns
    return q, k, v, seen.to(args.device), torch.tensor(args.used - Q, device=args.device)


def variants(args, torch):
    """name -> fn(q, k, v, seen, write_at) -> (B, H, Q, D)."""
    import torch.nn.functional as F

    groups = args.heads // args.kv_heads

    def mask4d(seen, write_at, Q):  # (B, 1, Q, L) bool: seen AND causal by column, as decoding.compiled.column_mask
        L = seen.shape[1]
        causal = torch.arange(L, device=seen.device) <= (write_at + torch.arange(Q, device=seen.device))[:, None]
        return seen[:, None, None, :] & causal

    def grouped(q, k, v, seen, write_at):
        B, H, Q, D = q.shape
        mask = mask4d(seen, write_at, Q).repeat(1, 1, groups, 1)
        out = F.scaled_dot_product_attention(q.reshape(B, H // groups, groups * Q, D), k, v, attn_mask=mask)
        return out.reshape(B, H, Q, D)

    def repeat(q, k, v, seen, write_at):
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask4d(seen, write_at, q.shape[2]))

    def gqa(q, k, v, seen, write_at):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask4d(seen, write_at, q.shape[2]), enable_gqa=True)

    def flex(q, k, v, seen, write_at):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, q_idx, kv_idx):
            return seen[b, kv_idx] & (kv_idx <= write_at + q_idx)

        block = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
        return flex_attention(q, k, v, block_mask=block, enable_gqa=True)

    def unmasked(q, k, v, seen, write_at):
        used = args.used
        return F.scaled_dot_product_attention(q, k[:, :, :used], v[:, :, :used], enable_gqa=True)

    return {"grouped": grouped, "repeat": repeat, "gqa": gqa, "flex": flex, "unmasked": unmasked}


def time_call(fn, args, torch) -> float:
    """Median microseconds per call after 2 warm-up calls (CUDA events on CUDA)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(args.iters):
        if args.device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--queries", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--columns", type=int, default=512, help="static cache columns (all attended, masked)")
    ap.add_argument("--used", type=int, default=192, help="real columns (prompt and generated tokens)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--compile", action="store_true", help="each call compiled, as in a decode step's graph")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (H200: 4.8e12)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.heads % args.kv_heads or not args.queries <= args.used <= args.columns:
        raise SystemExit("need heads divisible by kv-heads and queries <= used <= columns")
    import torch

    q, k, v, seen, write_at = inputs(args, torch)
    fns = variants(args, torch)
    reference = fns["grouped"](q, k, v, seen, write_at).float()
    elem = k.element_size()
    timings = []
    for name in args.variants:
        fn = fns[name]
        if args.compile or name == "flex":
            fn = torch.compile(fn, fullgraph=True, dynamic=False)
        out = fn(q, k, v, seen, write_at)
        columns = args.used if name == "unmasked" else args.columns
        bytes_read = 2 * args.batch * args.kv_heads * columns * args.head_dim * elem
        us = time_call(lambda: fn(q, k, v, seen, write_at), args, torch)  # noqa: B023
        timing = Timing(name, us, bytes_read, bytes_read / args.bandwidth / (us * 1e-6),
                        float((out.float() - reference).abs().max()))
        timings.append(timing)
        print(f"{name:9s} {us:10.1f} us/call  {bytes_read / 1e6:9.1f} MB  {timing.fraction:6.3f} of bandwidth  "
              f"max |diff| {timing.max_abs_diff:.2e}", flush=True)
    result = {"command": "python -m benchmarks.decode_attention " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "shape": {k: getattr(args, k) for k in (
                  "batch", "queries", "heads", "kv_heads", "head_dim", "columns", "used")},
              "compiled": args.compile, "timings": [asdict(t) for t in timings]}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
