"""Peak memory of the EAGLE-3 head's training-time-test (TTT) attention: the fused implementation
(specdistill.drafts.eagle3.model._ttt_attend, one scaled_dot_product_attention call per step) against the naive one
(naive_ttt_attend, beside it) that materialises the (B, heads, T, T) scores, for one training step (forward +
backward) at a given length and depth.

Each measurement runs in its own process: it resets the kernel's peak-RSS mark (/proc/self/clear_refs), runs the
step, and reports VmHWM minus the RSS before the step. glibc is told to serve every block of 64 KiB or more with mmap
(MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the RSS at once and the mark is the peak of live tensor memory.
Linux only.

Two measurements per implementation:
  attention  the attention alone, as the head's unroll calls it: steps x (queries over the step-0 keys under the
             causal mask, plus one diagonal per earlier step), on random q/k/v that need grad, then backward;
  head       one training step of a whole head (hidden = heads x head_dim, a 256-token vocabulary so the output
             layer is negligible): its TTT unroll, a cross-entropy at every slot and step, backward.

Usage:  python -m benchmarks.ttt_memory [--seq-len 2048] [--steps 7] [--heads 4] [--head-dim 32] [--batch 1]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _attention_step(attend, args) -> None:
    import torch

    from specdistill.drafts.eagle3.model import TTTMask, naive_ttt_attend

    B, nh, T, hd, steps = args.batch, args.heads, args.seq_len, args.head_dim, args.steps
    g = torch.Generator().manual_seed(0)
    leaf = lambda: torch.randn(B, nh, T, hd, generator=g).requires_grad_(True)  # noqa: E731
    k0, v0 = leaf(), leaf()
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]               # (1, 1, T, T)
    mask = causal if attend is naive_ttt_attend else TTTMask(causal, steps - 1)  # one bias buffer for the unroll
    diag_k, diag_v, total = [], [], 0.0
    for _ in range(steps):
        q = leaf()
        out = attend(q, k0, v0, mask, diag_k, diag_v, 1 / math.sqrt(hd))          # (B, nh, T, hd)
        total = total + out.square().mean()
        diag_k, diag_v = diag_k + [leaf()], diag_v + [leaf()]
    total.backward()


def _head_step(attend, args) -> None:
    import torch
    from specdistill.drafts.eagle3 import model as eagle3
    from specdistill.drafts.eagle3.model import Eagle3Config, Eagle3Head, naive_ttt_attend

    if attend is naive_ttt_attend:  # the head's unroll calls the module's function, with a TTTMask
        eagle3._ttt_attend = lambda q, k0, v0, mask, *rest: naive_ttt_attend(q, k0, v0, mask.allow, *rest)
    H, V, T, B = args.heads * args.head_dim, 256, args.seq_len, args.batch
    cfg = Eagle3Config(hidden_size=H, intermediate_size=2 * H, num_attention_heads=args.heads,
                       num_key_value_heads=args.heads, head_dim=args.head_dim, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=4 * T, vocab_size=V, draft_vocab_size=V, target_hidden_size=H,
                       aux_layer_ids=[1, 2, 3])
    torch.manual_seed(0)
    head = Eagle3Head(cfg).train()
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    aux = torch.randn(B, T, 3 * H)
    logits = head(aux, ids, mask, steps=args.steps)                               # steps x (B, T, V)
    loss = sum(torch.nn.functional.cross_entropy(x.flatten(0, 1), ids.flatten()) for x in logits)
    loss.backward()


def child(args) -> None:
    import torch

    from specdistill.drafts.eagle3.model import _ttt_attend, naive_ttt_attend

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    attend = {"fused": _ttt_attend, "naive": naive_ttt_attend}[args.impl]
    step = {"attention": _attention_step, "head": _head_step}[args.what]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    step(attend, args)
    print(json.dumps({"peak_mib": (_rss_kib("VmHWM") - before) / 1024}))


def measure(impl: str, what: str, args) -> float:
    cmd = [sys.executable, __file__, "--child", impl, what, "--seq-len", str(args.seq_len), "--steps",
           str(args.steps), "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--batch", str(args.batch)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mib"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--child", nargs=2, metavar=("IMPL", "WHAT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.impl, args.what = args.child
        return child(args)
    print(f"TTT attention peak memory, one training step: B={args.batch} T={args.seq_len} steps={args.steps} "
          f"heads={args.heads} head_dim={args.head_dim} (hidden {args.heads * args.head_dim})")
    for what in ("attention", "head"):
        naive, fused = measure("naive", what, args), measure("fused", what, args)
        print(f"  {what:9s}  naive {naive:8.1f} MiB   fused {fused:8.1f} MiB   fused/naive {fused / naive:.3f}")


if __name__ == "__main__":
    main()
