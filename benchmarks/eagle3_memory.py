"""Memory of one EAGLE-3 training step (the objective's TTT unroll, soft cross-entropy, backward) at a given shape, for
each way of computing it:
  plain       the head reads out (N_j, Vd) logits per step and the soft cross-entropy is plain autograd
              (losses.soft_ce.soft_cross_entropy: keeps the fp32 log-softmax and the gathered target p per step);
  fused       Eagle3Objective with checkpoint_steps=false: the fused soft cross-entropy
              (losses.soft_ce.linear_soft_cross_entropy), which keeps no (N_j, Vd) tensor and recomputes the logits
              in backward;
  fused+ckpt  Eagle3Objective with checkpoint_steps=true: each step's layer recomputed in backward as well;
  fused+ckpt-eager  the same with compile_loss=false: the soft cross-entropy's element-wise work op by op instead of
              torch.compile's fused kernels (the fused and fused+ckpt variants use them);
  objective   Eagle3Objective with its defaults, whatever the importable code is: with PYTHONPATH naming another
              checkout, --variants objective measures that code's objective.

What it reports, per variant, each measured in its own process:
  saved_mib  bytes of the distinct tensors autograd keeps for backward after the forward (saved-tensor hooks; the
             parameters excluded; a checkpointed region counts the inputs it keeps to recompute from);
  seconds    the wall time of forward + backward after one untimed warm-up step (on CPU, with mmap-served blocks: a
             rough guide only);
  peak_mib   CPU: the process's peak resident memory during forward + backward above the resident memory before it
             (glibc serves blocks of 64 KiB or more with mmap, so freed tensors leave at once; Linux only);
             CUDA: torch.cuda.max_memory_allocated during the step above the allocated memory before it.
On CUDA the step runs under bf16 autocast, as training does; on CPU in fp32.

The target is a stand-in of the right shapes (random features and draft-vocabulary logits at every loss position):
the step's memory does not depend on where they come from. The head is an Eagle3Head at the given width.

Usage (CPU, scaled down; the width ratios of Llama-3-8B with a 32k draft vocabulary):
    OMP_NUM_THREADS=1 python benchmarks/eagle3_memory.py --hidden 512 --heads 8 --kv-heads 2 --intermediate 1792 \
        --vocab 32064 --draft-vocab 8000 --batch 2 --seq-len 256 --steps 7
(CUDA, 8B width, micro-batch 8 x 1024, 7 steps):
    python benchmarks/eagle3_memory.py --device cuda --hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336 \
        --vocab 128256 --draft-vocab 32000 --batch 8 --seq-len 1024 --steps 7
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Iterable

import torch

VARIANTS = ("plain", "fused", "fused+ckpt", "fused+ckpt-eager")


class SavedBytes:
    """Within the context: the bytes of the distinct storages autograd saves for backward (those of `exclude`, the
    parameters, left out), plus the tensors torch.utils.checkpoint keeps as the inputs of a region it recomputes
    (the tensors saved inside such a region are its own, not kept)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _add(self, t) -> None:
        if isinstance(t, (list, tuple)):
            for x in t:
                self._add(x)
        elif isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.skip:
                self.storages[storage.data_ptr()] = storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._add(t)
        return t

    def __enter__(self) -> "SavedBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self._checkpoint = torch.utils.checkpoint.checkpoint

        def checkpoint(fn, *args, **kwargs):
            self._add(list(args))
            return self._checkpoint(fn, *args, **kwargs)

        torch.utils.checkpoint.checkpoint = checkpoint
        return self

    def __exit__(self, *exc) -> None:
        torch.utils.checkpoint.checkpoint = self._checkpoint
        self._hooks.__exit__(*exc)


def build(args, device):
    """(head, target stand-in, batch) at the shape `args` names."""
    from specdistill.drafts.eagle3.model import Eagle3Config, Eagle3Head
    from specdistill.models.target import DraftVocabTarget

    H, Vd, B, T = args.hidden, args.draft_vocab, args.batch, args.seq_len
    cfg = Eagle3Config(hidden_size=H, intermediate_size=args.intermediate, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, head_dim=H // args.heads, rms_norm_eps=1e-5,
                       rope_theta=5e5, max_position_embeddings=max(2 * T, 2048), vocab_size=args.vocab,
                       draft_vocab_size=Vd, target_hidden_size=H, aux_layer_ids=[2, 16, 29])
    torch.manual_seed(0)
    head = Eagle3Head(cfg).to(device).train()
    head.set_vocab(torch.randperm(args.vocab, device=device)[:Vd].sort().values)
    ids = torch.randint(0, args.vocab, (B, T), device=device)
    am = torch.ones(B, T, dtype=torch.long, device=device)
    lm = torch.ones(B, T, dtype=torch.long, device=device)
    lm[:, : T // 8] = 0  # a prompt that scores nothing
    N = int(lm.sum())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = DraftVocabTarget(logits=torch.randn(N, Vd, device=device, dtype=dtype) * 3,
                           in_vocab=torch.rand(N, device=device) < 0.9,
                           aux_hidden=torch.randn(B, T, 3 * H, device=device, dtype=dtype))

    class StandIn(torch.nn.Module):
        def draft_vocab_outputs(self, batch, positions, t2d):
            return out

    return head, StandIn(), {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


def plain_loss(head, target, batch, steps: int, decay: float) -> torch.Tensor:
    """The objective's loss with the plain soft cross-entropy on read-out logits."""
    from specdistill.losses.soft_ce import soft_cross_entropy
    from specdistill.tensors import shift_left

    ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"].bool()
    tgt = target.draft_vocab_outputs(batch, lm, head.t2d)
    row = torch.full(lm.shape, -1, dtype=torch.long, device=lm.device)
    row[lm] = torch.arange(tgt.logits.shape[0], device=lm.device)
    masks = [shift_left(lm, 1 + j, fill=False) for j in range(steps)]
    total = 0.0
    for j, (mask, q_logits) in enumerate(zip(masks, head(tgt.aux_hidden, ids, am, steps=steps, readout_at=masks))):
        sel = shift_left(row, 1 + j, fill=-1)[mask]
        total = total + soft_cross_entropy(q_logits, tgt.logits, sel, tgt.in_vocab[sel]).loss.sum() * decay ** j
    return total


def step_loss(variant: str, head, target, batch, steps: int) -> torch.Tensor:
    """The summed, decay-weighted loss of one micro-batch under `variant`."""
    from specdistill.objectives.base import Models
    from specdistill.objectives.eagle3 import Eagle3Objective

    if variant == "plain":
        return plain_loss(head, target, batch, steps, 0.8)
    knobs = {"fused": {"checkpoint_steps": False}, "fused+ckpt": {"checkpoint_steps": True},
             "fused+ckpt-eager": {"checkpoint_steps": True, "compile_loss": False}, "objective": {}}[variant]
    obj = Eagle3Objective(steps=steps, decay=0.8, **knobs)
    out = obj.loss(batch, Models(head, target))
    return (out.loss * out.weight).sum()


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def child(args) -> None:
    device = torch.device(args.device)
    head, target, batch = build(args, device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        step_loss(args.variant, head, target, batch, args.steps).backward()  # warm-up: compiled kernels, allocator
    head.zero_grad(set_to_none=True)
    params = list(head.parameters()) + list(head.buffers())
    counter = SavedBytes(exclude=params)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _rss_kib("VmRSS") * 1024
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"), counter:
        loss = step_loss(args.variant, head, target, batch, args.steps)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _rss_kib("VmHWM") * 1024 - before
    seconds = time.perf_counter() - start
    row = {"variant": args.variant, "saved_mib": counter.bytes / 2**20, "peak_mib": peak / 2**20, "seconds": seconds,
           "loss": float(loss)}
    if device.type == "cuda":  # the whole process's peak: the head's weights and gradients, the inputs, the step
        row["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(row))


def measure(variant: str, argv: list[str]) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, __file__, *argv, "--variant", variant], env=env, capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(f"{variant}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=896)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--draft-vocab", type=int, default=4000)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS + ('objective',)}")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.variant:
        return child(args)
    torch_threads = os.environ.get("OMP_NUM_THREADS", "")
    print(f"EAGLE-3 training step memory on {args.device}: B={args.batch} T={args.seq_len} steps={args.steps} "
          f"hidden={args.hidden} heads={args.heads}/{args.kv_heads} intermediate={args.intermediate} "
          f"vocab={args.vocab} draft_vocab={args.draft_vocab} (OMP_NUM_THREADS={torch_threads or 'unset'})")
    rows = [measure(v, argv) for v in args.variants.split(",")]
    base = rows[0]
    for r in rows:
        print(f"  {r['variant']:10s} saved {r['saved_mib']:9.1f} MiB ({r['saved_mib'] / base['saved_mib']:.3f} of "
              f"{base['variant']})   peak {r['peak_mib']:9.1f} MiB ({r['peak_mib'] / base['peak_mib']:.3f})   "
              f"time {r['seconds']:6.2f} s   loss {r['loss']:.6f}"
              + (f"   max allocated {r['cuda_max_allocated_mib']:9.1f} MiB" if "cuda_max_allocated_mib" in r else ""))


if __name__ == "__main__":
    main()
