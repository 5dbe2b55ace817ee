"""What every objective shares: the protocol the loop calls, the models it sees, the step output it returns, and
masked-logit helpers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class Models:
    draft: torch.nn.Module  # trainable (possibly wrapped by accelerate: DDP/FSDP)
    target: torch.nn.Module  # specdistill.models.target.Target, frozen
    tokenizer: Any = None
    decoding: Any = None  # decoding.CacheMode of rollouts (the run's eval.static_cache / eval.compile); None: growing


@dataclass
class StepOutput:
    """Per-token losses; the loop sums (loss * weight) and divides once by the global count of loss tokens, the sum
    of the objective's num_tokens over the step's micro-batches and ranks (train/loop.py: accumulate)."""
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


class Objective:
    """The protocol between the loop (train/loop.py: accumulate) and an objective. Once per optimizer step, before
    its micro-batches, the loop calls `objective.prepare_step(micro_batches, models)` (no-grad work over the whole
    step: Draft-OPD's step-wide rollout). Then per micro-batch, ONE micro-batch at a time:

      n        = objective.num_tokens_before_prepare(batch)  # () loss tokens, when the data alone tells; else None
      prepared = objective.prepare(batch, models)   # no-grad work before the loss (Draft-OPD: rollouts, replay)
      n        = objective.num_tokens(prepared)     # () loss tokens loss(prepared) returns (used when n was None)
      out      = objective.loss(prepared, models)   # StepOutput with grad; the loop backpropagates it

    then, after the step's last micro-batch, `metrics = objective.end_step()` (deferred state updates: Draft-OPD's
    replay buffer), and state_dict() / load_state_dict() at checkpoints (per rank). Subclasses are dataclasses of
    their config knobs (made from the config by objectives.make_objective); runtime state (buffers, RNG, counters)
    lives in a separate object that state_dict() saves. The defaults suit objectives on the data's own loss tokens.
    """

    # True when prepare() decodes with the target (rollouts): how many target forwards a micro-batch costs then
    # depends on its data, so processes cannot run a target sharded over them (target.shard=fsdp) in step.
    target_calls_depend_on_data = False

    def check_draft_kind(self, kind) -> None:
        """Before anything loads (build.py): refuse a draft kind (a drafts.DraftAdapter class) this objective's
        settings cannot train, naming the fix. Default: the kinds trained by token-level losses on the data (an LM
        draft: its spec's data_objective "kd"), and a kind whose data loss is its own (an EAGLE-3 head, a DFlash
        drafter) only under that objective (its draft has no next-token logits of its own to distil)."""
        own = kind.spec.data_objective
        if own not in ("kd", getattr(self, "name", None)):
            raise ValueError(f"objective={getattr(self, 'name', type(self).__name__)} cannot train a {kind.kind} "
                             f"draft: it trains with objective={own} (its own loss over the target's hidden states). "
                             f"Use objective={own} (the {kind.kind} recipes set it), or an LM draft "
                             "(draft=from_target or draft=small_lm) for this objective")

    def prepare_step(self, micro: list[dict], models: Models) -> None:
        """Before a step's micro-batches are prepared, with all of them in hand. Default: nothing."""

    def num_tokens_before_prepare(self, batch: dict) -> Optional[torch.Tensor]:
        return batch["loss_mask"].sum()

    def prepare(self, batch: dict, models: Models) -> Any:
        return batch

    def num_tokens(self, prepared: Any) -> torch.Tensor:
        return prepared["loss_mask"].sum()

    def loss(self, prepared: Any, models: Models) -> StepOutput:
        raise NotImplementedError

    def end_step(self) -> dict[str, torch.Tensor]:
        """After the optimizer step's last micro-batch: apply deferred state updates; detached metric sums."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned (stateless objectives ignore it)."""

    def __call__(self, batch: dict, models: Models) -> StepOutput:
        """One micro-batch as a whole step: prepare + loss + end_step (tests, and objectives reusing another's loss)."""
        out = self.loss(self.prepare(batch, models), models)
        out.metrics.update(self.end_step())
        return out
