"""Training throughput against this machine's roofline: FLOPs per loss token counted once, matmul peak measured once.

The FLOPs come from torch's own counter (torch.utils.flop_counter.FlopCounterMode, which counts every matmul and
convolution of forward and backward at dispatch), run over one optimizer step; the peak is a dense matmul
microbenchmark of the training dtype on the training device. Their ratio to the achieved rate says how much of the
machine a step uses, so "make it faster" starts from where the time goes, not from a guess.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class FlopCount:
    result: Any
    flops: int  # forward + backward FLOPs of the counted call (a multiply-add is 2 FLOPs)


def count_flops(fn: Callable[[], Any]) -> FlopCount:
    """Run fn() once under torch's FLOP counter."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        result = fn()
    return FlopCount(result, int(counter.get_total_flops()))


def matmul_gflops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024,
                  seconds: float = 0.3) -> float:
    """Measured dense (n x n) @ (n x n) rate in GFLOPS on this device and dtype, with the current thread setting."""
    device = torch.device(device)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b  # warm-up
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        a @ b
        reps += 1
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and reps >= 3:
            return 2 * n ** 3 * reps / elapsed / 1e9


@dataclass
class Roofline:
    peak_gflops: float  # measured matmul rate of the whole job (per-process rate x processes)
    flops_per_token: float  # counted FLOPs of one optimizer step / its loss tokens

    def achieved_gflops(self, tokens_per_s: float) -> float:
        return tokens_per_s * self.flops_per_token / 1e9

    def fraction(self, tokens_per_s: float) -> float:
        """Achieved / peak: 1.0 would be every core doing dense matmuls all the time."""
        return self.achieved_gflops(tokens_per_s) / max(self.peak_gflops, 1e-9)

    def metrics(self, tokens_per_s: float) -> dict:
        return {"train/flops_per_token": self.flops_per_token, "train/achieved_gflops": self.achieved_gflops(tokens_per_s),
                "train/peak_gflops": self.peak_gflops, "train/roofline_fraction": self.fraction(tokens_per_s)}
