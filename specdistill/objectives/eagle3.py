"""EAGLE-3 training-time test (Li et al. 2025): a k-step unroll of the head on its own features, soft CE against
the target's distribution restricted to the draft vocabulary, steps weighted decay^j."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from specdistill.constraints import bounded, check_fields
from specdistill.losses.soft_ce import linear_soft_cross_entropy
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
    # recompute each unrolled step's layer in backward instead of keeping its activations: one more layer forward per
    # step for most of the unroll's activation memory (benchmarks/eagle3_memory.py measures both)
    checkpoint_steps: bool = True
    # the soft cross-entropy's element-wise work (softmaxes, products, sums over the draft vocabulary) as fused compiled
    # kernels (torch.compile: Triton on CUDA, C++ on the CPU; compiled once per process), else op by op
    compile_loss: bool = True

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
        p_logits = tgt.logits.detach()  # (N, Vd): softmax = p restricted to the draft vocabulary, renormalised
        with torch.no_grad():
            p_argmax = p_logits.float().softmax(-1).argmax(-1)  # (N,)
        row = torch.full(lm.shape, -1, dtype=torch.long, device=lm.device)  # (B, T): row of p_logits per loss position
        row[lm] = torch.arange(p_logits.shape[0], device=lm.device)
        # slot t at step j predicts token t+2+j: the target's distribution for it sits at position t+1+j, and the
        # loss counts iff that position is a loss position (loss_mask[t+1+j]). Only those slots are read out.
        masks = [shift_left(lm, 1 + j, fill=False) for j in range(self.steps)]  # k x (B, T)
        sels = [shift_left(row, 1 + j, fill=-1)[mask] for j, mask in enumerate(masks)]  # k x (N_j,)

        def soft_ce(j, h, weight):  # h (N_j, H) normed features, weight (Vd, H): soft CE, out-of-vocab targets masked
            out = linear_soft_cross_entropy(h, weight, p_logits, rows=sels[j], mask=tgt.in_vocab[sels[j]],
                                            compiled=self.compile_loss)
            return out.loss, out.q_argmax  # (N_j,), (N_j,)

        step_ce = head(tgt.aux_hidden, ids, am, steps=self.steps, readout_at=masks, score=soft_ce,
                       checkpoint=self.checkpoint_steps)  # k x ((N_j,), (N_j,))
        losses, weights, metrics = [], [], {}
        for j, (mask, sel, (ce, q_argmax)) in enumerate(zip(masks, sels, step_ce)):
            losses.append(ce)
            weights.append(torch.full_like(ce, self.decay ** j))
            with torch.no_grad():
                correct = (q_argmax == p_argmax[sel]) & tgt.in_vocab[sel]
                metrics[f"acc_step{j}_sum"] = correct.sum().float()
                metrics[f"acc_step{j}_count"] = mask.sum().float()  # no host sync: reduced at log time
        metrics["loss_sum"] = sum((l * w).sum() for l, w in zip(losses, weights)).detach()
        return StepOutput(torch.cat(losses), torch.cat(weights), metrics)
