"""What every objective shares: the models it sees, the step output it returns, and masked-logit helpers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class Models:
    draft: torch.nn.Module  # trainable (possibly wrapped by accelerate: DDP/FSDP)
    target: torch.nn.Module  # specdistill.models.target.Target, frozen
    tokenizer: Any = None


@dataclass
class StepOutput:
    """Per-token losses; the loop sums (loss * weight) and divides once by the global count of loss tokens: the data's
    loss_mask tokens, or, for an objective with a `num_tokens(batch, models) -> ()` tensor method (on-policy
    positions), the sum of what that method returns; the loop calls it before any backward of the step."""
    loss: torch.Tensor  # (N,) per loss token, differentiable
    weight: Optional[torch.Tensor] = None  # (N,) detached weights (acceptance weighting); None = all ones
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # detached SUMS over this micro-batch; ratios later


def keep_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Sequence positions where any row has a loss token: (T',) long, for `logits_to_keep` (saves the head's
    (B, T, V) output on prompt positions)."""
    return loss_mask.any(0).nonzero().squeeze(-1)


def masked_logits(model, batch: dict, keep: torch.Tensor) -> torch.Tensor:
    """Logits at the loss positions only: (N, V) with N = loss_mask.sum(). Calls the model's own forward (so a
    DDP/FSDP wrapper still syncs gradients)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=keep,
                use_cache=False)
    logits = out.logits  # (B, T', V)
    return logits[batch["loss_mask"][:, keep].bool()]  # (N, V)


def labels_at_loss(batch: dict) -> torch.Tensor:
    """Next-token labels at the loss positions: (N,)."""
    nxt = torch.roll(batch["input_ids"], -1, dims=1)  # position t predicts token t+1
    return nxt[batch["loss_mask"].bool()]
