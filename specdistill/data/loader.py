"""Deterministic, shardable micro-batches whose position is a pure function of the optimizer step.

We go around accelerate's prepared DataLoader + skip_first_batches on purpose: with the permutation fixed by
(seed, epoch) and each rank taking every world_size-th example, resuming at step s restarts at exactly the
micro-batch an uninterrupted run would have used, with no iterator state to save.
"""
from __future__ import annotations

from dataclasses import dataclass

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
                             f"{self.world_size} ranks x {self.grad_accum} x {self.micro_batch_size}: add data or lower "
                             "trainer.micro_batch_size / trainer.grad_accum")
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
