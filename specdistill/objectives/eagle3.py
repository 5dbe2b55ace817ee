"""EAGLE-3 training-time test (Li et al. 2025): a k-step unroll of the head on its own features, soft CE against
the target's distribution restricted to the draft vocabulary, steps weighted decay^j."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdistill.constraints import bounded, check_fields
from specdistill.models.vocab import restrict_to_draft_vocab
from specdistill.objectives.base import Models, Objective, StepOutput
from specdistill.tensors import shift_left, unwrap


def draft_vocab_targets(p_logits: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits (..., V) -> (probs over the draft vocab renormalised (..., Vd), in_vocab (...,) bool: whether the
    target's argmax is in the draft vocabulary; positions where it is not are masked, as in EAGLE-3)."""
    logits, in_vocab = restrict_to_draft_vocab(p_logits, t2d)
    return logits.float().softmax(-1), in_vocab  # softmax over kept ids == p restricted and renormalised


@dataclass
class Eagle3Objective(Objective):
    name: str = "eagle3"
    steps: int = bounded(7, ">= 1")  # unrolled TTT steps (k)
    decay: float = bounded(0.8, "(0, 1]")  # step j weighted decay^j (EAGLE, SpecForge); 1.0 weighs steps equally

    def __post_init__(self):
        check_fields(self, "objective")  # the ranges on the fields above

    def loss(self, batch: dict, models: Models) -> StepOutput:
        ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"].bool()
        head = models.draft
        t2d = unwrap(head).t2d
        # The target's distribution over the draft vocabulary at every loss position, computed once for all steps
        # (from stored features: only the Vd kept rows of its output layer).
        tgt = models.target.draft_vocab_outputs(batch, lm, t2d)  # logits (N, Vd), in_vocab (N,), aux (B, T, 3Ht)
        if tgt.aux_hidden is None:
            raise ValueError("the eagle3 objective needs the target's aux hidden states: build it with draft=eagle3")
        p_all = tgt.logits.float().softmax(-1)  # (N, Vd): p restricted to the draft vocabulary, renormalised
        row = torch.full(lm.shape, -1, dtype=torch.long, device=lm.device)  # (B, T): row of p_all per loss position
        row[lm] = torch.arange(p_all.shape[0], device=lm.device)
        # slot t at step j predicts token t+2+j: the target's distribution for it sits at position t+1+j, and the
        # loss counts iff that position is a loss position (loss_mask[t+1+j]). Only those slots are read out.
        masks = [shift_left(lm, 1 + j, fill=False) for j in range(self.steps)]  # k x (B, T)
        step_logits = head(tgt.aux_hidden, ids, am, steps=self.steps, readout_at=masks)  # k x (N_j, Vd)
        losses, weights, metrics = [], [], {}
        for j, (mask, q_logits) in enumerate(zip(masks, step_logits)):
            sel = shift_left(row, 1 + j, fill=-1)[mask]  # (N_j,)
            p, in_vocab = p_all[sel], tgt.in_vocab[sel]  # (N_j, Vd), (N_j,)
            q_log = F.log_softmax(q_logits.float(), -1)  # (N_j, Vd)
            ce = -(p * q_log).sum(-1) * in_vocab  # soft CE; out-of-vocab targets masked
            losses.append(ce)
            weights.append(torch.full_like(ce, self.decay ** j))
            with torch.no_grad():
                correct = (q_log.argmax(-1) == p.argmax(-1)) & in_vocab
                metrics[f"acc_step{j}_sum"] = correct.sum().float()
                metrics[f"acc_step{j}_count"] = mask.sum().float()  # no host sync: reduced at log time
        metrics["loss_sum"] = sum((l * w).sum() for l, w in zip(losses, weights)).detach()
        return StepOutput(torch.cat(losses), torch.cat(weights), metrics)
