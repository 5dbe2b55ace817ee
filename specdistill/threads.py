"""Torch CPU threads, set deliberately by every entry point: physical cores / local processes unless overridden.

Torch's default (all logical CPUs, per process) oversubscribes a machine running several ranks or another job: a
3-prompt evaluation on a busy 2-core box took 8 m 50 s with the default and 1 m 02 s with one thread, and the
measured speedup moved from 0.15x to 0.37x. Knows nothing about models; reads /proc and the environment only.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class ThreadSetting:
    threads: int
    physical_cores: int
    local_processes: int
    source: str  # "override" | "OMP_NUM_THREADS" | "physical cores / local processes"
    load_average: Optional[float] = None
    busy: bool = False

    def line(self) -> str:
        s = (f"[threads] torch uses {self.threads} CPU thread(s) per process ({self.source}; "
             f"{self.physical_cores} physical cores, {self.local_processes} local process(es))")
        if self.load_average is not None:
            s += f"; load average {self.load_average:.2f}"
        return s

    def to_dict(self) -> dict:
        return {"threads": self.threads, "physical_cores": self.physical_cores,
                "local_processes": self.local_processes, "source": self.source, "load_average": self.load_average,
                "busy": self.busy}


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def physical_cores(cpuinfo: str = "/proc/cpuinfo") -> int:
    """Distinct (physical id, core id) pairs, capped by the CPUs this process may run on; logical CPUs otherwise."""
    cores = set()
    try:
        phys = core = None
        with open(cpuinfo) as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    phys = val.strip()
                elif key == "core id":
                    core = val.strip()
                elif not line.strip():
                    if core is not None:
                        cores.add((phys, core))
                    phys = core = None
        if core is not None:
            cores.add((phys, core))
    except OSError:
        pass
    n = len(cores) or (os.cpu_count() or 1)
    return max(1, min(n, usable_cpus()))


def local_processes() -> int:
    """Processes of this job on this machine (torchrun / accelerate set LOCAL_WORLD_SIZE)."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(var, "")
        if v.isdigit() and int(v) > 0:
            return int(v)
    return 1


def choose_threads(override: Optional[int] = None) -> ThreadSetting:
    cores, procs = physical_cores(), local_processes()
    if override:
        n, source = int(override), "override"
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        n, source = int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    else:
        n, source = max(1, cores // procs), "physical cores / local processes"
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    # busy: the load already present leaves fewer free cores than the threads this job is about to use
    busy = load is not None and load + n * procs > usable_cpus() + 0.5 and load >= 0.75 * usable_cpus()
    return ThreadSetting(n, cores, procs, source, load, busy)


def configure_threads(override: Optional[int] = None, key: str = "trainer.threads",
                      log: Optional[Callable[[str], None]] = print) -> ThreadSetting:
    """Set torch's intra-op threads, print the setting, and warn when the load average says the machine is busy."""
    import torch

    s = choose_threads(override)
    torch.set_num_threads(s.threads)
    if log is not None:
        log(s.line() + f"; override with {key}=N")
        if s.busy:
            log(f"[threads] warning: the machine is busy (load average {s.load_average:.2f} on {usable_cpus()} CPUs): "
                f"timings will be slow and noisy; {key}=1 is usually fastest on a shared box")
    return s
