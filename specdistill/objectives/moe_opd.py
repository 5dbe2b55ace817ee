"""MoE-OPD: Draft-OPD (objectives/draft_opd.py) for drafts built from an MoE target's hot experts, plus the
expert-level loss of objectives/moe_kd.py on the data batch's loss tokens.

Composition, not a copy: every on-policy mechanism (speculative rollouts with the current draft, replay of
rejected positions, acceptance weighting, the optional kd_weight term) is DraftOPDObjective's. This objective adds,
per call, one target forward over the data batch with hooks on the source layers' MoE blocks (the rollout's target
forwards run on other tokens) and appends expert_weight x the expert loss of each data loss token to the per-position
losses; `num_tokens(prepared)` counts those tokens too, so the loop's single normalisation stays a mean over everything
returned. expert_weight=0 is plain Draft-OPD on an expert-selective draft.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.constraints import bounded
from specdistill.objectives.base import Models, StepOutput
from specdistill.objectives.draft_opd import DraftOPDObjective
from specdistill.objectives.moe_kd import SourceCapture, expert_level_loss
from specdistill.tensors import unwrap, unwrap_target


@dataclass
class MoEOPDObjective(DraftOPDObjective):
    name: str = "moe_opd"
    expert_weight: float = bounded(1.0, ">= 0")  # draft experts match their source experts on the data's loss tokens
    # Draft-OPD's __post_init__ checks the constraints of every field, this one included.

    def _meta(self, models: Models):
        draft = unwrap(models.draft)
        meta = getattr(getattr(draft, "config", None), "specdistill_moe", None)
        if self.expert_weight and not meta:
            raise ValueError("objective=moe_opd with expert_weight > 0 needs a draft built from the target's experts "
                             "(draft=moe_experts or draft=moe_dense); set objective.expert_weight=0 otherwise")
        return meta

    def _expert_tokens(self, batch: dict) -> int:
        return int(batch["loss_mask"].sum()) if self.expert_weight else 0

    def prepare(self, batch: dict, models: Models):
        self._meta(models)
        return super().prepare(batch, models)

    def num_tokens(self, prepared) -> torch.Tensor:
        return super().num_tokens(prepared) + self._expert_tokens(prepared.batch)

    def loss(self, prepared, models: Models) -> StepOutput:
        meta = self._meta(models)
        out = super().loss(prepared, models)
        batch = prepared.batch
        if not self._expert_tokens(batch):
            return out
        if "final_hidden" in batch:
            raise ValueError("objective=moe_opd's expert loss needs the target's forward (its expert inputs): unset "
                             "data.offline_dir or set objective.expert_weight=0")
        tmodel = unwrap_target(models.target)
        with SourceCapture(tmodel, meta["source_layers"]) as cap, torch.no_grad():
            tmodel(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                   logits_to_keep=1)
        draft = unwrap(models.draft)
        sel = batch["loss_mask"].reshape(-1).bool()
        expert, kept_share = expert_level_loss(draft, tmodel, meta, cap, sel)  # (N,) each
        weight = out.weight if out.weight is not None else torch.ones_like(out.loss)
        metrics = dict(out.metrics)
        n = torch.as_tensor(float(expert.numel()), device=expert.device)
        metrics.update(expert_sum=expert.detach().sum(), expert_count=n,
                       kept_routing_share_sum=kept_share.sum(), kept_routing_share_count=n)
        metrics["loss_sum"] = metrics["loss_sum"] + self.expert_weight * expert.detach().sum()
        return StepOutput(torch.cat([out.loss, expert]),
                          torch.cat([weight, torch.full_like(expert, self.expert_weight).detach()]), metrics)
