"""Model FLOPs utilisation (MFU) of training: FLOPs per real token counted once, the device's dense peak measured once.

The FLOPs come from torch's own counter (specdistill/flops.py: every matmul and convolution of forward and backward,
less what activation checkpointing recomputes), run over one optimizer step and restated per real token (padding
slots excluded). The peak is the dense matmul rate of the training dtype on the training device, timed on products
large enough that the device's own time, not the host's launch cost, sets the rate. Their ratio to the achieved rate
says how much of the machine a step uses, so "make it faster" starts from where the time goes, not from a guess.
"""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


from specdistill.flops import FlopCount, count_flops  # noqa: F401  (the loop's FLOP count: model work, no recompute)


# ---- the device's dense peak ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceClock:
    """Points on a device's timeline. mark() records a point after all work issued so far; seconds(a, b) waits for
    b and returns the device seconds from a to b."""
    mark: Callable[[], Any]
    seconds: Callable[[Any, Any], float]


def cuda_clock(device: torch.device) -> DeviceClock:
    """CUDA events on the device's current stream: device time, whatever the host does between the marks."""
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def seconds(a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        b.synchronize()
        return a.elapsed_time(b) / 1e3  # elapsed_time is in milliseconds

    return DeviceClock(mark, seconds)


def host_clock(sync: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter) -> DeviceClock:
    """The host's clock read after a sync (the CPU, or a device without timing events)."""
    def mark() -> float:
        sync()
        return clock()

    return DeviceClock(mark, lambda a, b: b - a)


def clock_for(device: torch.device) -> DeviceClock:
    if device.type == "cuda":
        return cuda_clock(device)
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    return host_clock(getattr(backend, "synchronize", None) or (lambda: None))


def seconds_per_op(op: Callable[[], Any], reps: int, clock: DeviceClock) -> float:
    """Device seconds of one op() over `reps` calls issued back to back. The call before the first mark keeps an
    asynchronous device busy while the timed calls are issued, so once an op lasts longer than its launch the host's
    launch cost hides behind device work and the reading is the device's."""
    op()
    start = clock.mark()
    for _ in range(reps):
        op()
    return clock.seconds(start, clock.mark()) / reps


@dataclass(frozen=True)
class MatmulRate:
    flops_per_s: float
    size: int     # n of the (n x n) @ (n x n) product
    op_s: float   # device seconds of one product


def measure_matmul_peak(make_product: Callable[[int], Callable[[], Any]], clock: DeviceClock, *, start: int = 256,
                        max_size: int = 16384, min_op_s: float = 1e-4, max_op_s: float = 0.02, reps: int = 3,
                        trials: int = 3, min_gain: float = 1.05) -> MatmulRate:
    """The best dense (n x n) @ (n x n) rate: n doubles from `start` until one product lasts >= min_op_s on the
    device AND the rate gained less than min_gain over the previous size (a rate still growing that fast with n is
    bounded by launch cost or by too few output tiles to fill the device), or a product lasts >= max_op_s, or n would
    pass max_size. Each size: one warm-up product, then the best of `trials` timings of `reps` products.

    make_product(n) returns a function issuing one product of size n (operands allocated once); clock marks the
    device's timeline (clock_for). Both are parameters so that a fake device can check the search."""
    if start < 1 or max_size < start or reps < 1 or trials < 1:
        raise ValueError(f"measure_matmul_peak: need 1 <= start <= max_size, reps >= 1, trials >= 1; got start={start} "
                         f"max_size={max_size} reps={reps} trials={trials}")
    best: Optional[MatmulRate] = None
    n = start
    while True:
        op = make_product(n)
        op()  # warm-up: allocation, kernel choice
        op_s = min(seconds_per_op(op, reps, clock) for _ in range(trials))
        del op  # the operands go before the next size's are allocated
        rate = MatmulRate(2 * n ** 3 / max(op_s, 1e-12), n, op_s)
        grew = best is None or rate.flops_per_s > min_gain * best.flops_per_s
        if best is None or rate.flops_per_s > best.flops_per_s:
            best = rate
        if (op_s >= min_op_s and not grew) or op_s >= max_op_s or 2 * n > max_size:
            return best
        n *= 2


@dataclass(frozen=True)
class PublishedPeak:
    """A datasheet's dense (no sparsity) tensor-core rate of the devices whose name contains `name` and none of
    `unless`."""
    name: str
    unless: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    flops_per_s: float


HALF = (torch.bfloat16, torch.float16)
# NVIDIA datasheets, dense bf16/fp16 (A100: SXM and PCIe alike). H100/H200 PCIe and NVL parts are slower and not
# listed: they get the measured figure.
PUBLISHED_DENSE_PEAKS = (
    PublishedPeak("H200", ("NVL", "PCIe"), HALF, 989.4e12),
    PublishedPeak("H100", ("NVL", "PCIe"), HALF, 989.4e12),
    PublishedPeak("A100", (), HALF, 312e12),
)


def published_peak(device_name: str, dtype: torch.dtype) -> Optional[PublishedPeak]:
    """The table's entry for this device name and dtype, or None."""
    for p in PUBLISHED_DENSE_PEAKS:
        if p.name in device_name and not any(u in device_name for u in p.unless) and dtype in p.dtypes:
            return p
    return None


@dataclass(frozen=True)
class DevicePeak:
    """The dense matmul peak MFU is a fraction of: the datasheet figure when the device is in PUBLISHED_DENSE_PEAKS,
    else the measured one; the measured figure is always kept beside it."""
    flops_per_s: float           # the peak MFU divides by (one device)
    source: str                  # "measured" or "published (<device> <dtype> dense)"
    size: int                    # n of the timed (n x n) @ (n x n) products
    dtype: str                   # e.g. "bfloat16"
    measured_flops_per_s: float  # the best measured rate
    device: str                  # the device's name

    def describe(self) -> str:
        measured = f"measured {self.measured_flops_per_s / 1e12:.3g} TFLOP/s ({self.size}^3 {self.dtype} products)"
        if self.source == "measured":
            return f"{self.device}: dense peak {measured}"
        return f"{self.device}: dense peak {self.flops_per_s / 1e12:.4g} TFLOP/s {self.source}; {measured}"

    def as_dict(self) -> dict:
        return {"peak/flops_per_s": self.flops_per_s, "peak/source": self.source, "peak/size": self.size,
                "peak/dtype": self.dtype, "peak/measured_flops_per_s": self.measured_flops_per_s,
                "peak/device": self.device}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def device_peak(device: torch.device | str = "cpu", dtype: Optional[torch.dtype] = None, *,
                published: bool = True) -> DevicePeak:
    """The dense matmul peak of one device in `dtype` (default: bf16 on CUDA, fp32 elsewhere, as training runs),
    measured with products sized by measure_matmul_peak (CUDA events on CUDA; the host clock after a sync
    elsewhere) with the current torch thread setting. published=False: the measured figure even where the
    datasheet's is known."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def make_product(n: int) -> Callable[[], Any]:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        out = torch.empty(n, n, device=device, dtype=dtype)
        return lambda: torch.mm(a, b, out=out)

    measured = measure_matmul_peak(make_product, clock_for(device))
    name = device_name(device)
    dtype_name = str(dtype).removeprefix("torch.")
    sheet = published_peak(name, dtype) if published else None
    if sheet is None:
        return DevicePeak(measured.flops_per_s, "measured", measured.size, dtype_name, measured.flops_per_s, name)
    return DevicePeak(sheet.flops_per_s, f"published ({sheet.name} {dtype_name} dense)", measured.size, dtype_name,
                      measured.flops_per_s, name)


# ---- FLOPs on real tokens, and MFU ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepFlops:
    """A counted optimizer step restated per real token. The step computes over every slot of its right-padded
    micro-batches; a padding slot costs what a real token costs and does no useful work, so the useful FLOPs are
    the real tokens' share. Exact for per-token work (every linear layer); attention's cost grows with the row's
    length and the loss-position head's does not grow with padding, so those parts are estimated to first order."""
    flops: int   # counted FLOPs (specdistill.flops: no recomputation), padding slots included
    slots: int   # sum of B x T over the step's micro-batches
    tokens: int  # real tokens among them (attention_mask.sum())

    @property
    def flops_per_token(self) -> float:
        return self.flops / max(self.slots, 1)

    @property
    def useful_flops(self) -> float:
        return self.flops_per_token * self.tokens


def step_flops(flops: int, micro: list[dict]) -> StepFlops:
    """The step's counted FLOPs with its micro-batches' slots and real tokens (attention_mask (B, T) of each)."""
    masks = [b["attention_mask"] for b in micro]
    return StepFlops(int(flops), sum(m.numel() for m in masks), int(sum(int(m.sum()) for m in masks)))


@dataclass(frozen=True)
class Mfu:
    peak_flops_per_s: float  # the whole job's: DevicePeak.flops_per_s x processes
    flops_per_token: float   # StepFlops.flops_per_token: forward + backward FLOPs of one real input token

    def achieved_flops_per_s(self, tokens_per_s: float) -> float:
        """tokens_per_s: real input tokens (attention_mask) per second over the job."""
        return tokens_per_s * self.flops_per_token

    def fraction(self, tokens_per_s: float) -> float:
        """Achieved / peak: 1.0 would be every device doing dense matmuls at its peak all the time."""
        return self.achieved_flops_per_s(tokens_per_s) / max(self.peak_flops_per_s, 1e-9)

    def metrics(self, tokens_per_s: float) -> dict:
        return {"train/flops_per_token": self.flops_per_token,
                "train/achieved_tflops": self.achieved_flops_per_s(tokens_per_s) / 1e12,
                "train/mfu": self.fraction(tokens_per_s)}
