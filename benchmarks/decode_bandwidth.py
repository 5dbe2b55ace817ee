"""Target-only decoding (decoding.target_generate) against its memory-bandwidth floor, per batch size and cache mode.

A random-weight Llama-3.1-8B-shaped target (--layers of its 32, bf16 on CUDA) decodes --new-tokens tokens after
--prompt random prompt tokens, per batch size: one warm-up call (compiles, for the compiled mode), then one timed
call. The floor of one decode step is the bytes it must read (every weight a step multiplies by, and each row's keys
and values of its real tokens) over the device's bandwidth (--bandwidth, bytes/s; H200 4.8e12); the fraction is
floor / measured step time. The goal is >= 0.5 for the compiled mode at batch 1 and 128 on a GPU. Imports
specdistill.decoding, torch and transformers only.

  python -m benchmarks.decode_bandwidth --batches 1 128 --modes growing compiled --out decode_bandwidth.json
  python -m benchmarks.decode_bandwidth --device cpu --tiny     # the script's own check, seconds
  python -m benchmarks.decode_bandwidth --batches 1 128 --modes compiled --sync-every 8 --count-ops

--count-ops: one more call under torch.profiler, counting the operators the host issues per step outside compiled
graphs, and of them those that compute (HostOps): on a GPU each of those is a kernel launch, whose host time bounds a
small step.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass
class Point:
    batch: int
    mode: str
    sync_every: int
    decode_steps: int
    step_ms: float            # mean decode step (the prefill apart)
    floor_ms: float           # bytes a step reads / bandwidth
    fraction: float           # floor_ms / step_ms
    tokens_per_s: float       # generated tokens over the decode time
    compiles: int             # the compiled mode's graphs compiled (warm-up and timed call together)
    compiles_in_timed_call: int
    host_ops_per_step: float | None = None      # --count-ops: operators the host issued per step (HostOps)
    host_kernels_per_step: float | None = None  # of them, the ones that compute (not views or no-op casts)


ATTENTIONS = ("sdpa_grouped", "sdpa")  # what load_causal_lm gives a grouped-query model, and transformers' own sdpa

# Operators that only make a view of a tensor or read its metadata (no device kernel on a GPU), and casts that return
# their input: counted apart from the operators that compute.
VIEW_OPS = frozenset(f"aten::{name}" for name in (
    "slice", "select", "unsqueeze", "squeeze", "expand", "view", "alias", "as_strided", "t", "transpose", "permute",
    "reshape", "_unsafe_view", "detach", "to", "lift_fresh", "empty", "resolve_conj", "resolve_neg", "result_type",
    "item", "_local_scalar_dense", "is_nonzero", "size", "stride", "numel", "dim"))


@dataclass
class HostOps:
    """The operators the host issued outside compiled graphs while a function ran: top-level aten operators (not
    inside another operator, nor inside a compiled region, whose graph the host launches as one)."""

    ops: int      # all of them
    kernels: int  # those that compute (on a GPU at least one kernel launch each, ~5-20 us of host time): not VIEW_OPS


def host_ops(fn):
    """(HostOps of fn(), fn()'s result), counted under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()

    def counted(event) -> bool:
        if not event.name.startswith("aten::"):
            return False
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::") or "Compiled" in parent.name:
                return False
            parent = parent.cpu_parent
        return True

    top = [e.name for e in prof.events() if counted(e)]
    return HostOps(len(top), sum(name not in VIEW_OPS for name in top)), out


def build_target(layers: int, tiny: bool, device: str, dtype, attention: str = ATTENTIONS[0]):
    """A random Llama-3.1-8B-shaped target (--tiny: toy sizes) attending with `attention` (ATTENTIONS)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        config = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024)
    else:  # Llama-3.1-8B's shapes
        config = LlamaConfig(vocab_size=128256, hidden_size=4096, num_hidden_layers=layers, num_attention_heads=32,
                             num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=8192,
                             rope_theta=500000.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    if attention == ATTENTIONS[0]:
        try:
            from specdistill.models.attention import use_grouped_sdpa
        except ImportError:  # a source tree (--tree) from before the grouped attention
            raise SystemExit("--attention sdpa_grouped: this source tree has no specdistill.models.attention; "
                             "pass --attention sdpa") from None
        use_grouped_sdpa(model)
    elif attention != "sdpa":
        raise SystemExit(f"--attention {attention!r}: one of {ATTENTIONS}")
    return model.eval().requires_grad_(False)


def step_bytes(model, batch: int, context: float) -> float:
    """Bytes one decode step reads: the weights it multiplies by (not the input embedding table, of which it gathers
    rows) and each row's keys and values of `context` real tokens."""
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    params = total - (embed.numel() if embed.data_ptr() != head.data_ptr() else 0)
    elem = next(model.parameters()).element_size()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * batch * c.num_key_value_heads * head_dim * context * elem
    return params * elem + kv


def measure(model, batch: int, mode_name: str, prompt: int, new_tokens: int, bandwidth: float, backend: str,
            profile: bool = False, sync_every: int = 1, count_ops: bool = False) -> Point:
    import torch

    from specdistill.decoding import CacheMode, compile_stats, target_generate

    mode = {"growing": CacheMode(), "static": CacheMode(static=True),
            "compiled": CacheMode(compile=True, backend=backend)}[mode_name]
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(10, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    run = lambda: target_generate(model, ids, mask, max_new_tokens=new_tokens, cache=mode,  # noqa: E731
                                  sync_every=sync_every)
    run()  # warm-up
    before = compile_stats(model).total_compiles
    if device.type == "cuda":
        torch.cuda.synchronize()
    roll = run()
    if profile:  # a third call under torch.profiler: where a step's time goes (device kernels against the host)
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            run()
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"--- batch {batch} {mode_name}: top ops by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
    compiles_timed = compile_stats(model).total_compiles - before
    steps = len(roll.round_seconds)
    step_s = roll.decode_seconds / steps
    floor_s = step_bytes(model, batch, prompt + (new_tokens - 1) / 2) / bandwidth
    point = Point(batch, mode_name, sync_every, steps, 1e3 * step_s, 1e3 * floor_s, floor_s / step_s,
                  int(roll.num_new_tokens.sum()) / roll.decode_seconds, compile_stats(model).total_compiles,
                  compiles_timed)
    if count_ops:  # one more call, counted (the prefill's operators shared out over the steps)
        ops, counted = host_ops(run)
        point.host_ops_per_step = ops.ops / len(counted.round_seconds)
        point.host_kernels_per_step = ops.kernels / len(counted.round_seconds)
    return point


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy model sizes (the CPU check)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the 8B-shaped target")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--modes", nargs="+", default=["growing", "compiled"], choices=("growing", "static", "compiled"))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (H200: 4.8e12)")
    ap.add_argument("--backend", default="inductor", help="CacheMode backend of the compiled mode (eager: CPU check)")
    ap.add_argument("--attention", default=ATTENTIONS[0], choices=ATTENTIONS,
                    help="the target's attention function (sdpa_grouped: what load_causal_lm gives it)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="print where a call's time goes (torch.profiler)")
    ap.add_argument("--sync-every", type=int, nargs="+", default=[1], help="target_generate's sync_every values")
    ap.add_argument("--count-ops", action="store_true", help="host operators per step outside compiled graphs")
    args = ap.parse_args(argv)
    import torch

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    model = build_target(args.layers, args.tiny, args.device, dtype, args.attention)
    points = []
    for batch in args.batches:
        for mode, sync_every in ((m, k) for m in args.modes for k in args.sync_every):
            p = measure(model, batch, mode, args.prompt, args.new_tokens, args.bandwidth, args.backend,
                        args.profile, sync_every, args.count_ops)
            points.append(p)
            print(f"batch {p.batch:4d} {p.mode:9s} sync_every {p.sync_every} step {p.step_ms:8.3f} ms  "
                  f"floor {p.floor_ms:7.3f} ms  "
                  f"fraction {p.fraction:6.3f}  {p.tokens_per_s:9.0f} tok/s  compiles {p.compiles} "
                  f"(timed call: {p.compiles_in_timed_call})"
                  + ("" if p.host_ops_per_step is None else
                     f"  host ops/step {p.host_ops_per_step:.1f} ({p.host_kernels_per_step:.1f} computing)"),
                  flush=True)
    result = {"command": "python -m benchmarks.decode_bandwidth " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "attention": args.attention, "seconds": time.perf_counter() - t0,
              "points": [asdict(p) for p in points]}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
