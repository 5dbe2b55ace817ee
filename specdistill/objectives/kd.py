"""KD: a divergence between the target's and the draft's next-token distributions on the data's loss tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.losses import DIVERGENCES, acceptance_rate, cross_entropy, divergence
from specdistill.objectives.base import (Models, Objective, StepOutput, keep_positions, labels_at_loss,
                                        masked_logits)


@dataclass
class KDObjective(Objective):
    name: str = "kd"
    divergence: str = "fkl"  # fkl | rkl | jsd | tvd | acceptance
    beta: float = 0.5  # jsd only: 0 = forward KL, 1 = reverse KL
    temperature: float = 1.0
    sft_weight: float = 0.0  # adds sft_weight * CE on the data tokens

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"objective.divergence={self.divergence!r}: choose one of {DIVERGENCES}")
        if self.temperature <= 0:
            raise ValueError("objective.temperature must be > 0")

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
