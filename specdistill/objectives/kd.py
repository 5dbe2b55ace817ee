"""KD: a divergence between the target's and the draft's next-token distributions on the data's loss tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.constraints import bounded, check_fields, one_of
from specdistill.losses import DIVERGENCES, acceptance_rate, cross_entropy, divergence
from specdistill.objectives.base import (Models, Objective, StepOutput, keep_positions, labels_at_loss,
                                        masked_logits)


@dataclass
class KDObjective(Objective):
    name: str = "kd"
    divergence: str = one_of("fkl", DIVERGENCES)
    beta: float = bounded(0.5, "[0, 1]")  # jsd only: 0 = forward KL, 1 = reverse KL
    temperature: float = bounded(1.0, "> 0")
    sft_weight: float = bounded(0.0, ">= 0")  # adds sft_weight * CE on the data tokens

    def __post_init__(self):
        check_fields(self, "objective")  # the ranges and choices on the fields above

    def loss(self, batch: dict, models: Models) -> StepOutput:
        keep = keep_positions(batch["loss_mask"])
        sel = batch["loss_mask"][:, keep].bool()
        p_logits = models.target.outputs(batch, logits_to_keep=keep).logits[sel]  # (N, V)
        q_logits = masked_logits(models.draft, batch, keep)  # (N, V)
        loss = divergence(self.divergence, p_logits, q_logits, beta=self.beta, temperature=self.temperature)
        if self.sft_weight:
            loss = loss + self.sft_weight * cross_entropy(q_logits, labels_at_loss(batch))
        with torch.no_grad():
            agree = (p_logits.argmax(-1) == q_logits.argmax(-1)).sum()
            alpha = acceptance_rate(p_logits, q_logits).sum()
        return StepOutput(loss, metrics={"loss_sum": loss.detach().sum(), "target_top1_agree": agree,
                                         "alpha_sum": alpha})
