"""FLOPs of a call as the model's work: torch's own counter (torch.utils.flop_counter.FlopCounterMode, every matmul and
convolution of forward and backward at dispatch), less what activation checkpointing recomputes in backward.

Model FLOPs utilisation counts each FLOP of the model once; a checkpointed region's forward runs again in backward to
rebuild what it did not keep, which is the price of the memory saved, not work of the model (that would be hardware
FLOPs utilisation). torch.utils.checkpoint calls take `context_fn=checkpoint_contexts`: while count_flops runs, their
recomputation is counted apart and subtracted.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

_recomputed: Optional[list[int]] = None  # while count_flops runs: the FLOPs each recomputation counted


@dataclass
class FlopCount:
    result: Any
    flops: int       # forward + backward FLOPs of the counted call, recomputation excluded (a multiply-add is 2)
    recomputed: int  # FLOPs checkpointed regions recomputed in backward (counted apart, not in `flops`)


class _Recomputation:
    """A checkpointed region's recomputation: counted apart while count_flops runs, nothing otherwise."""

    def __enter__(self):
        self._counter = None
        if _recomputed is not None:
            from torch.utils.flop_counter import FlopCounterMode

            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()
        return self

    def __exit__(self, *exc):
        if self._counter is not None:
            self._counter.__exit__(*exc)
            if _recomputed is not None:
                _recomputed.append(int(self._counter.get_total_flops()))
        return False


def counting() -> bool:
    """Whether count_flops is running: torch.compile'd code first called under its counter (a dispatch mode) would
    stay eager for good, so compiled kernels run their eager form meanwhile (the matmuls, and so the count, are the
    same)."""
    return _recomputed is not None


def checkpoint_contexts():
    """torch.utils.checkpoint.checkpoint's context_fn: (the forward's context, the recomputation's context)."""
    return nullcontext(), _Recomputation()


def count_flops(fn: Callable[[], Any]) -> FlopCount:
    """Run fn() once under torch's FLOP counter; the recomputation of regions checkpointed with checkpoint_contexts is
    left out of `flops` (and reported as `recomputed`)."""
    from torch.utils.flop_counter import FlopCounterMode

    global _recomputed
    outer, _recomputed = _recomputed, []
    try:
        with FlopCounterMode(display=False) as counter:
            result = fn()
        recomputed = sum(_recomputed)
    finally:
        _recomputed = outer
    return FlopCount(result, int(counter.get_total_flops()) - recomputed, recomputed)
