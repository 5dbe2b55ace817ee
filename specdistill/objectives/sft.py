"""SFT: cross-entropy of the draft on the data's assistant tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.losses import cross_entropy
from specdistill.objectives.base import (Models, Objective, StepOutput, keep_positions, labels_at_loss,
                                        masked_logits)


@dataclass
class SFTObjective(Objective):
    name: str = "sft"

    def loss(self, batch: dict, models: Models) -> StepOutput:
        keep = keep_positions(batch["loss_mask"])
        logits = masked_logits(models.draft, batch, keep)  # (N, V)
        labels = labels_at_loss(batch)  # (N,)
        loss = cross_entropy(logits, labels)
        with torch.no_grad():
            correct = (logits.argmax(-1) == labels).sum()
        return StepOutput(loss, metrics={"loss_sum": loss.detach().sum(), "data_top1": correct})
