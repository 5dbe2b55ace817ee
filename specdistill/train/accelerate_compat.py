"""The one call into accelerate's private API: telling it which backward ends an optimizer step.

The loop accumulates a step's micro-batches itself rather than through `Accelerator.accumulate()`, because a step's
micro-batch count changes with the run's phase (a warm-up phase may set its own grad_accum), while `accumulate()`
counts against the one `gradient_accumulation_steps` fixed when the Accelerator is built. accelerate still reads its
gradient state at each backward and step:
- DeepSpeed's engine reduces the gradients and steps its optimizer inside `backward` exactly when `sync_gradients`;
- the wrapped optimizer and scheduler skip `step()` and `zero_grad()` while it is false.
So the loop sets it before each backward: false while accumulating, true on a step's last micro-batch.
"""
from __future__ import annotations

import accelerate
from accelerate import Accelerator


def set_gradient_sync(accelerator: Accelerator, sync: bool) -> None:
    """Mark the next backward as a step's last (`sync=True`) or as one that accumulates (`sync=False`).

    `GradientState._set_sync_gradients` is what `Accelerator.accumulate()` itself calls (it also marks the XLA step
    on TPUs); accelerate has no public equivalent for a loop that counts its own micro-batches.
    """
    setter = getattr(accelerator.gradient_state, "_set_sync_gradients", None)
    if setter is None:
        raise RuntimeError(
            f"accelerate {accelerate.__version__} has no GradientState._set_sync_gradients, which the training loop "
            "needs to mark a step's last micro-batch; install an accelerate 1.x or adapt "
            "specdistill/train/accelerate_compat.py to the new API")
    setter(bool(sync))
