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

    return sustained_gflops(lambda: a @ b, sync, 2 * n ** 3, seconds)


def sustained_gflops(op: Callable[[], Any], sync: Callable[[], None], flops: float, seconds: float = 0.3,
                     clock: Callable[[], float] = time.perf_counter) -> float:
    """GFLOPS of op() (flops each) issued back to back with one sync per batch, as a training step issues its kernels.

    A sync after every op would add a launch-and-wait round trip to each (on a GPU, often longer than a small matmul),
    reading the peak several times too low and so the roofline fraction too high. The batch doubles until one batch
    lasts seconds / 4; the last batch's rate is the peak (the round trip is then spread over the whole batch)."""
    op()  # warm-up
    sync()
    batch = 1
    while True:
        t0 = clock()
        for _ in range(batch):
            op()
        sync()
        elapsed = clock() - t0
        if elapsed >= seconds / 4 or batch >= 1 << 20:
            return flops * batch / max(elapsed, 1e-12) / 1e9
        batch *= 2


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
        return {"train/flops_per_token": self.flops_per_token,
                "train/achieved_gflops": self.achieved_gflops(tokens_per_s),
                "train/peak_gflops": self.peak_gflops, "train/roofline_fraction": self.fraction(tokens_per_s)}
