"""Where a training step's time goes: torch.profiler over a few optimizer steps, summarised as device time per kind of
work and as the factors MFU is the product of.

On CUDA the device's time is its kernels' (matmul kernels by name: cuBLAS's gemm/nvjet/xmma/cutlass families), so
the summary says how busy the device was and on what. On the CPU the "kernels" are the operators' own host time.
With the step's counted FLOPs the summary splits MFU into three factors:

    MFU = matmul kernel rate / peak      (how fast the matmuls themselves run)
        x matmul share of device time    (how much of the device's work is matmuls)
        x device busy fraction           (how much of the wall time the device works at all: host-bound or syncing
                                          when low)

so a low MFU points at its cause: slow kernels, memory-bound work around them, or an idle device.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

MATMUL = "matmul"
# (group, substrings of a CUDA kernel's name, case-insensitive); first match wins
KERNEL_GROUPS = (
    ("attention", ("fmha", "flash", "attention", "attn")),
    (MATMUL, ("gemm", "nvjet", "xmma", "cutlass", "gemv", "cublas", "matmul", "triton_tem")),
    ("elementwise / fused", ("triton",)),  # inductor's fused kernels (their names list the ops they fuse)
    ("softmax / log_softmax", ("softmax",)),
    ("optimizer", ("multi_tensor_apply", "adam", "foreach")),
    ("copies / indexing", ("memcpy", "memset", "copy", "index", "gather", "scatter", "cat_", "catarray")),
    ("reductions", ("reduce",)),
    ("elementwise / fused", ("elementwise", "vectorized", "unrolled")),
)
# (group, prefixes of a CPU operator's name); first match wins
OP_GROUPS = (
    ("attention", ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_flash", "aten::_efficient")),
    (MATMUL, ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")),
    ("softmax / log_softmax", ("aten::_softmax", "aten::_log_softmax", "aten::softmax", "aten::log_softmax")),
    ("optimizer", ("Optimizer.step", "aten::_foreach", "aten::addcdiv", "aten::lerp")),
    ("copies / indexing", ("aten::index", "aten::gather", "aten::scatter", "aten::masked", "aten::copy_",
                           "aten::_to_copy", "aten::cat", "aten::clone", "aten::roll", "aten::nonzero",
                           "aten::repeat_interleave", "aten::where")),
)
OTHER = "other"


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((g for g, parts in KERNEL_GROUPS if any(p in low for p in parts)), OTHER)


def op_group(name: str) -> str:
    return next((g for g, prefixes in OP_GROUPS if name.startswith(prefixes)), OTHER)


@dataclass(frozen=True)
class Work:
    """One profiled name's total: a CUDA kernel (or memcpy / memset), or on the CPU an operator's own host time."""
    name: str
    seconds: float
    calls: int


@dataclass
class ProfileSummary:
    device: str                 # "cuda" | "cpu"
    steps: int                  # profiled optimizer steps
    wall_s: float               # their wall time (the profiler's overhead included)
    busy_s: float               # the device's work in it: kernel time (CUDA), operators' own time (CPU)
    groups_s: dict[str, float]  # busy_s by kind of work, largest first
    top: list[dict]             # the largest single names: {name, seconds, calls, group}
    flops: Optional[float] = None          # the profiled steps' counted FLOPs (real tokens), when known
    peak_flops_per_s: Optional[float] = None
    factors: dict = field(default_factory=dict)  # MFU and the three factors it is the product of (module doc)

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / max(self.wall_s, 1e-12)

    def to_dict(self) -> dict:
        return {**asdict(self), "busy_fraction": self.busy_fraction}


def summarize(work: Iterable[Work], device: str, steps: int, wall_s: float, *, flops: Optional[float] = None,
              peak_flops_per_s: Optional[float] = None, top: int = 15) -> ProfileSummary:
    """The profiled work grouped by kind (kernel_group on CUDA, op_group elsewhere), with the MFU factors when the
    steps' FLOPs and the device's peak are known."""
    work = [w for w in work if w.seconds > 0]
    group = kernel_group if device == "cuda" else op_group
    groups: dict[str, float] = {}
    for w in work:
        groups[group(w.name)] = groups.get(group(w.name), 0.0) + w.seconds
    busy = sum(groups.values())
    largest = sorted(work, key=lambda w: -w.seconds)[:top]
    summary = ProfileSummary(device, steps, wall_s, busy, dict(sorted(groups.items(), key=lambda kv: -kv[1])),
                             [{**asdict(w), "group": group(w.name)} for w in largest], flops, peak_flops_per_s)
    matmul_s = groups.get(MATMUL, 0.0)
    if flops and peak_flops_per_s and matmul_s > 0 and wall_s > 0:
        summary.factors = {
            "mfu": flops / wall_s / peak_flops_per_s,
            "matmul_rate_of_peak": flops / matmul_s / peak_flops_per_s,  # counted FLOPs over the matmul kernels' time
            "matmul_share_of_busy": matmul_s / busy,
            "busy_fraction": busy / wall_s,
        }
    return summary


def profiled_work(prof, device: str) -> list[Work]:
    """The profiler's totals per name: CUDA kernels and copies on CUDA (the operators that launched them left out,
    so nothing counts twice), the operators' own host time on the CPU."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.key_averages():
        if device == "cuda":
            if e.device_type == DeviceType.CUDA:
                out.append(Work(e.key, e.self_device_time_total / 1e6, e.count))
        elif e.device_type == DeviceType.CPU:
            out.append(Work(e.key, e.self_cpu_time_total / 1e6, e.count))
    return out


@contextmanager
def profiling(device: torch.device) -> Iterator[list]:
    """torch.profiler around the block (CPU activity, and CUDA's on CUDA), the device synchronised at both ends so
    the wall time holds the block's device work. Yields a list that holds [profiler, wall seconds] afterwards."""
    import time

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    box: list = []
    with profile(activities=activities) as prof:
        sync()
        t0 = time.perf_counter()
        yield box
        sync()
        box[:] = [prof, time.perf_counter() - t0]


def markdown(summary: ProfileSummary, command: str = "") -> str:
    """profile.md: the breakdown as tables."""
    s = summary
    lines = ([f"`{command}`", ""] if command else []) + [
        f"{s.steps} profiled step(s) on {s.device}: {s.wall_s:.3f} s wall, the device busy {s.busy_s:.3f} s "
        f"({100 * s.busy_fraction:.0f}%)" + (" (CPU: the operators' own host time)" if s.device != "cuda" else ""), ""]
    if s.factors:
        f = s.factors
        lines += [f"MFU {100 * f['mfu']:.1f}% = matmul kernels at {100 * f['matmul_rate_of_peak']:.0f}% of the peak "
                  f"({s.peak_flops_per_s / 1e12:.4g} TFLOP/s) x matmul share {100 * f['matmul_share_of_busy']:.0f}% "
                  f"of the device's work x device busy {100 * f['busy_fraction']:.0f}% of the wall time "
                  f"({s.flops / 1e12:.4g} TFLOP counted over the steps)", ""]
    lines += ["| where the device's time goes | seconds | share |", "|---|---|---|"]
    lines += [f"| {g} | {sec:.3f} | {100 * sec / max(s.busy_s, 1e-12):.0f}% |" for g, sec in s.groups_s.items()]
    lines += ["", "| largest | group | seconds | calls |", "|---|---|---|---|"]
    lines += [f"| `{t['name'][:90]}` | {t['group']} | {t['seconds']:.3f} | {t['calls']} |" for t in s.top]
    return "\n".join(lines) + "\n"


def write(out_dir: Path, summary: ProfileSummary, command: str = "", extra: Optional[dict] = None) -> Path:
    """profile.json and profile.md into out_dir; returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "profile.json"
    path.write_text(json.dumps({"command": command, **summary.to_dict(), **(extra or {})}, indent=1))
    (out_dir / "profile.md").write_text(markdown(summary, command))
    return path
