"""Deterministic, shardable micro-batches whose position is a pure function of the optimizer step.

We go around accelerate's prepared DataLoader + skip_first_batches on purpose: with the permutation fixed by
(seed, epoch) and each rank taking every world_size-th example, resuming at step s restarts at exactly the
micro-batch an uninterrupted run would have used, with no iterator state to save. Prefetcher loads and collates
the next steps' micro-batches in a background thread (the same batches, in the same order).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from specdistill.data.chat import collate


@dataclass
class StepBatches:
    dataset: object  # an indexable dataset of {input_ids, loss_mask}
    micro_batch_size: int
    grad_accum: int
    pad_id: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1

    def __post_init__(self):
        per_rank = len(self.dataset) // self.world_size
        self.steps_per_epoch = per_rank // (self.micro_batch_size * self.grad_accum)
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(self.dataset)} training examples are too few for one optimizer step of "
                             f"{self.world_size} ranks x {self.grad_accum} x {self.micro_batch_size}: add data or "
                             "lower trainer.micro_batch_size / trainer.grad_accum")
        self._epoch, self._order = None, None

    def _rank_order(self, epoch: int) -> list[int]:
        if self._epoch != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            perm = torch.randperm(len(self.dataset), generator=g).tolist()
            usable = (len(perm) // self.world_size) * self.world_size
            self._order, self._epoch = perm[:usable][self.rank::self.world_size], epoch
        return self._order

    def micro_batches(self, step: int) -> list[dict]:
        """The grad_accum micro-batches (collated, on CPU) of optimizer step `step` (0-based) on this rank."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._rank_order(epoch)
        n = self.micro_batch_size
        start = within * self.grad_accum * n
        return [collate([self.dataset[i] for i in order[start + a * n: start + (a + 1) * n]], self.pad_id)
                for a in range(self.grad_accum)]

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch


class Prefetcher:
    """The micro-batches of the coming optimizer steps, loaded and collated by a background thread while the current
    step computes, `depth` steps ahead.

    `load(step)` returns a step's micro-batches (a pure function of the step, as StepBatches.micro_batches is), so
    the batches and their order are those the loop would load itself, and a resume at step s starts the thread at s.
    With `pin=True` (a CUDA device) each tensor is put in pinned memory, so the loop's `.to(device, non_blocking=True)`
    copies asynchronously. `wait_s` counts the seconds get() spent blocked on data (the loop's data wait). With
    depth=0 there is no thread: get() loads the step itself.
    """

    def __init__(self, load: Callable[[int], list[dict]], start: int, stop: int, depth: int = 2, pin: bool = False):
        self.next_step, self.wait_s = start, 0.0
        self._load, self._pin = load, pin
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._closed = threading.Event()
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, args=(start, stop), daemon=True,
                                            name="specdistill-prefetch")
            self._thread.start()

    def _loaded(self, step: int) -> list[dict]:
        batches = self._load(step)
        if self._pin:
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
        return batches

    def _run(self, start: int, stop: int) -> None:
        for step in range(start, stop):
            try:
                item = self._loaded(step)
            except BaseException as e:  # noqa: BLE001 - handed to the loop, which raises it at this step
                item = e
            while not self._closed.is_set():
                try:
                    self._queue.put((step, item), timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._closed.is_set() or isinstance(item, BaseException):
                return

    def get(self, step: int) -> list[dict]:
        """Step `step`'s micro-batches; steps are taken in order, one after another, from `start`."""
        if step != self.next_step:
            raise RuntimeError(f"the prefetcher serves step {self.next_step} next, not step {step}: steps are taken "
                               "in order")
        t0 = time.perf_counter()
        item = self._queue.get()[1] if self._thread is not None else self._loaded(step)
        self.wait_s += time.perf_counter() - t0
        self.next_step += 1
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the thread (a run that ends early leaves batches unread)."""
        self._closed.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
