"""MoE-KD: output-level KD plus expert-level distillation for drafts built from an MoE target's hot experts.

Expert level (specdistill/moe/build.py records which target layer and experts each draft layer came from):
hooks on the target's sparse blocks capture, in the same target forward that gives the KD logits, each source
layer's MLP input x (the post-attention-norm hidden state), its block output and the router's top-k choice and
weights. On the loss positions:
- draft MoE layer (kind=moe): draft expert e' (copied from target expert e) is run on the *target's* x of the
  tokens the target routed to e, and matched to expert e's output, recomputed from the frozen target weights on
  the same x (fused HF experts expose no per-expert outputs). Per token: sum over its routed kept experts of the
  target routing weight x squared error; tokens routed only to dropped experts add nothing.
- draft dense layer (kind=dense): the draft MLP on the target's x is matched to the target block's output.
Errors are mean squares over H divided by the batch's mean square of the source block output (a relative
error, so layers of different scale weigh alike), averaged over draft layers. Teacher-forced inputs mean the
expert loss trains only the draft's expert / MLP weights; the output-level KD trains everything.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from specdistill.constraints import bounded, check_fields, one_of
from specdistill.losses import DIVERGENCES, acceptance_rate, cross_entropy, divergence
from specdistill.moe.routing import decoder_layers, expert_forward, require_moe
from specdistill.objectives.base import (Models, Objective, StepOutput, keep_positions, labels_at_loss,
                                        masked_logits)
from specdistill.tensors import unwrap


class SourceCapture:
    """Forward hooks on target MoE blocks `layers`: per layer, x (B*T, H), block output (B*T, H), router top-k
    weights and ids (B*T, k), all detached, from the target's own forward."""

    def __init__(self, target_model, layers: list[int]):
        blocks = require_moe(target_model)
        self.blocks = {s: blocks[s] for s in layers}
        self.x, self.y, self.weights, self.index = {}, {}, {}, {}
        self._handles = []

    def __enter__(self):
        for s, block in self.blocks.items():
            self._handles.append(block.register_forward_hook(self._block_hook(s)))
            self._handles.append(block.gate.register_forward_hook(self._router_hook(s)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def _block_hook(self, s):
        def hook(module, args, output):
            x = args[0]
            self.x[s] = x.detach().reshape(-1, x.shape[-1])
            self.y[s] = output.detach().reshape(-1, x.shape[-1])
        return hook

    def _router_hook(self, s):
        def hook(module, args, output):
            self.weights[s], self.index[s] = output[1].detach(), output[2].detach()
        return hook


def expert_level_loss(draft, target_model, meta: dict, cap: SourceCapture, sel: torch.Tensor):
    """Per-loss-token expert loss (N,) and the share of the target's routing weight on kept experts (N,).
    sel: (B*T,) bool loss positions in the routers' flattened order."""
    t_blocks = require_moe(target_model)
    d_layers = decoder_layers(draft)
    n = int(sel.sum())
    total = None
    kept_share = None
    for j, (s, kept) in enumerate(zip(meta["source_layers"], meta["experts"])):
        x, y_block = cap.x[s][sel], cap.y[s][sel]  # (N, H)
        w, idx = cap.weights[s][sel].float(), cap.index[s][sel]  # (N, k)
        scale = y_block.float().pow(2).mean().clamp_min(1e-12)
        per_tok = x.new_zeros(n, dtype=torch.float32)
        d_mlp = d_layers[j].mlp
        if meta["kind"] == "dense":
            y_d = d_mlp(x[None]).reshape(n, -1)
            per_tok = per_tok + (y_d.float() - y_block.float()).pow(2).mean(-1) / scale
        else:
            for e_draft, e in enumerate(kept):
                hit = idx == e  # (N, k)
                rows = hit.any(-1).nonzero().squeeze(-1)
                if rows.numel() == 0:
                    continue
                with torch.no_grad():
                    y_src = expert_forward(t_blocks[s].experts, e, x[rows])
                y_d = expert_forward(d_mlp.experts, e_draft, x[rows])
                err = (y_d.float() - y_src.float()).pow(2).mean(-1) / scale
                per_tok = per_tok.index_add(0, rows, (w * hit).sum(-1)[rows] * err)
        total = per_tok if total is None else total + per_tok
        with torch.no_grad():
            on_kept = torch.isin(idx, torch.tensor(kept, device=idx.device))
            share = (w * on_kept).sum(-1) / w.sum(-1).clamp_min(1e-12)
            kept_share = share if kept_share is None else kept_share + share
    L = len(meta["source_layers"])
    return total / L, kept_share / L


@dataclass
class MoEKDObjective(Objective):
    name: str = "moe_kd"
    divergence: str = one_of("fkl", DIVERGENCES)  # output level
    beta: float = bounded(0.5, "[0, 1]")  # jsd only
    temperature: float = bounded(1.0, "> 0")
    kd_weight: float = bounded(1.0, ">= 0")  # output-level divergence
    expert_weight: float = bounded(1.0, ">= 0")  # expert-level matching (0 = plain KD on an expert-selective draft)
    sft_weight: float = bounded(0.0, ">= 0")  # CE on the data tokens

    def __post_init__(self):
        check_fields(self, "objective")  # the ranges and choices on the fields above

    def loss(self, batch: dict, models: Models) -> StepOutput:
        draft = unwrap(models.draft)
        meta = getattr(draft.config, "specdistill_moe", None)
        if self.expert_weight and not meta:
            raise ValueError("objective=moe_kd with expert_weight > 0 needs a draft built from the target's experts "
                             "(draft=moe_experts or draft=moe_dense); set objective.expert_weight=0 otherwise")
        if self.expert_weight and "final_hidden" in batch:
            raise ValueError("objective=moe_kd's expert loss needs the target's forward (its expert inputs): it "
                             "cannot run on offline features (unset data.offline_dir or set objective.expert_weight=0)")
        keep = keep_positions(batch["loss_mask"])
        sel_keep = batch["loss_mask"][:, keep].bool()
        layers = meta["source_layers"] if self.expert_weight else []
        tmodel = models.target.model
        with SourceCapture(tmodel, layers) if layers else nullcontext() as cap:
            p_logits = models.target.outputs(batch, logits_to_keep=keep).logits[sel_keep]  # (N, V)
        q_logits = masked_logits(models.draft, batch, keep)  # (N, V)
        kd = divergence(self.divergence, p_logits, q_logits, beta=self.beta, temperature=self.temperature)  # (N,)
        loss = self.kd_weight * kd
        metrics = {"kd_sum": kd.detach().sum()}
        if self.expert_weight:
            sel = batch["loss_mask"].reshape(-1).bool()
            expert, kept_share = expert_level_loss(draft, tmodel, meta, cap, sel)
            loss = loss + self.expert_weight * expert
            metrics.update(expert_sum=expert.detach().sum(), kept_routing_share_sum=kept_share.sum())
        if self.sft_weight:
            loss = loss + self.sft_weight * cross_entropy(q_logits, labels_at_loss(batch))
        with torch.no_grad():
            agree = (p_logits.argmax(-1) == q_logits.argmax(-1)).sum()
            metrics.update(loss_sum=loss.detach().sum(), target_top1_agree=agree,
                           alpha_sum=acceptance_rate(p_logits, q_logits).sum())
        return StepOutput(loss, metrics=metrics)

