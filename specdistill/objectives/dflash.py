"""DFlash block training (Chen et al. 2026): random anchors in each sequence, one non-causal block per anchor, a loss at
every block position weighted by an exponential position decay.

For an anchor a (a token of the row whose next token is a loss token), the block [x_a, MASK x (B-1)] reads the target's
features at positions < a; block position k (1 .. B-1) is trained to predict x_{a+k}, whose target distribution sits at
position a+k-1 (logits there predict the next token), counted iff loss_mask[a+k-1]. Two targets:
  kd  soft cross-entropy against the target's distribution (from the stored final hidden states, or a target forward);
  ce  cross-entropy on the target's greedy token (regenerated greedy data: the token it emitted).
Position k weighs exp(-(k-1) / decay_length): early positions decide acceptance, since a round accepts a prefix.
Both the draft's and the target's LM head run at the selected block positions only (N of them), never over the
whole (B, T) grid, and over the draft's vocabulary only (draft.draft_vocab_size: the target's LM-head rows of the
most frequent answer tokens; p restricted and renormalised, positions whose target token lies outside it masked).
Anchors come from a generator seeded by (seed, call count): a resumed run draws the same ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from specdistill.constraints import bounded, check_fields, one_of
from specdistill.objectives.base import Models, Objective, StepOutput
from specdistill.tensors import unwrap

TARGETS = ("kd", "ce")


def block_loss(q_logits: torch.Tensor, p_logits: Optional[torch.Tensor],
               labels: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-position loss (N,): soft CE -sum_x p(x) log q(x) when p_logits (N, V) is given, else CE on labels (N,).
    q_logits (N, V) the draft's."""
    q_log = F.log_softmax(q_logits.float(), -1)                                   # (N, V)
    if p_logits is not None:
        return -(p_logits.float().softmax(-1) * q_log).sum(-1)
    return F.nll_loss(q_log, labels, reduction="none")


def position_weights(block_size: int, decay_length: Optional[float], device=None) -> torch.Tensor:
    """(B-1,) weight of block positions 1 .. B-1: exp(-(k-1) / decay_length), all ones when decay_length is None."""
    k = torch.arange(block_size - 1, dtype=torch.float, device=device)
    return torch.ones_like(k) if decay_length is None else torch.exp(-k / decay_length)


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to n distinct anchors per row, uniformly among positions a >= 1 with loss_mask[a] (block position 1 is a
    loss token). loss_mask (R, T) bool -> anchors (R, n) long (0 where invalid), valid (R, n) bool."""
    R, T = loss_mask.shape
    ok = loss_mask.clone().cpu()
    ok[:, 0] = False
    keys = torch.rand(R, T, generator=generator).masked_fill(~ok, 2.0)          # candidates first, in random order
    order = keys.argsort(1)[:, :n]                                              # (R, n')
    valid = ok.gather(1, order)
    anchors = torch.where(valid, order, 0).sort(1).values                       # ascending, invalid (0) first
    valid = valid.sort(1).values                                                # the same count, invalid first
    if order.shape[1] < n:
        pad = n - order.shape[1]
        anchors = torch.cat([anchors.new_zeros(R, pad), anchors], 1)
        valid = torch.cat([valid.new_zeros(R, pad), valid], 1)
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


@dataclass
class _Prepared:
    batch: dict
    anchors: torch.Tensor   # (R, n) anchor positions
    valid: torch.Tensor     # (R, n) real anchors
    sel: torch.Tensor       # (R, n, B-1) block positions with a loss
    num_tokens: torch.Tensor


@dataclass
class DFlashObjective(Objective):
    name: str = "dflash"
    blocks_per_row: int = bounded(4, ">= 1")  # random anchors (blocks) per sequence per step
    target: str = one_of("kd", TARGETS)  # kd: soft CE against the target's distribution | ce: CE on its greedy token
    decay_length: Optional[float] = bounded(7.0, "> 0")  # position k weighs exp(-(k-1)/decay_length); null: equal
    seed: int = 0  # anchor sampling

    def __post_init__(self):
        check_fields(self, "objective")  # the ranges and choices on the fields above

    @property
    def calls(self) -> int:
        return self.__dict__.get("_calls", 0)

    def check_draft_kind(self, kind) -> None:
        if kind.spec.data_objective != "dflash":
            raise ValueError(f"objective=dflash trains DFlash block drafters; draft={kind.kind} trains with "
                             f"objective={kind.spec.data_objective}. Use draft=dflash (recipe=dflash_serve)")

    # ------------------------------------------------------------------------------------------- the protocol
    def num_tokens_before_prepare(self, batch: dict):
        return None  # the anchors decide the count

    @torch.no_grad()
    def prepare(self, batch: dict, models: Models) -> _Prepared:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.calls)
        self.__dict__["_calls"] = self.calls + 1
        B = unwrap(models.draft).block_size
        lm = batch["loss_mask"].bool()                                           # (R, T)
        anchors, valid = sample_anchors(lm, self.blocks_per_row, generator)     # (R, n)
        sel = self._positions(lm, anchors, valid, B)
        return _Prepared(batch, anchors, valid, sel, sel.sum())

    def num_tokens(self, prepared: _Prepared) -> torch.Tensor:
        return prepared.num_tokens

    def loss(self, prepared: _Prepared, models: Models) -> StepOutput:
        return self.block_terms(prepared.batch, models, prepared.anchors, prepared.sel)

    def block_terms(self, batch: dict, models: Models, anchors: torch.Tensor, sel: torch.Tensor) -> StepOutput:
        """The loss at the block positions `sel` (R, n, B-1) of the blocks anchored at `anchors` (R, n)."""
        draft = unwrap(models.draft)
        B = draft.block_size
        ids = batch["input_ids"]
        R, T = ids.shape
        at = (anchors[..., None] + torch.arange(B - 1, device=ids.device)).clamp(max=T - 1)  # (R, n, B-1) dist. pos.
        rows = torch.arange(R, device=ids.device)[:, None, None].expand_as(at)[sel]          # (N,)
        cols = at[sel]                                                                         # (N,)
        features, p_logits, labels, in_vocab = self._target(batch, models, rows, cols, draft.t2d)
        hidden = models.draft(features, batch["attention_mask"].bool(), ids.gather(1, anchors), anchors)  # (R,n,B,H)
        q_logits = draft.logits(hidden[:, :, 1:][sel])                                         # (N, Vd)
        # over a reduced draft vocabulary p is restricted and renormalised, and positions whose target token lies
        # outside it are masked (as the eagle3 objective does)
        loss = block_loss(q_logits, p_logits, labels) * in_vocab                               # (N,)
        k = torch.arange(B - 1, device=ids.device).expand_as(at)[sel]                         # (N,) position k - 1
        weight = position_weights(B, self.decay_length, ids.device)[k]
        metrics = {"loss_sum": (loss * weight).detach().sum()}
        with torch.no_grad():
            greedy = labels if labels is not None else p_logits.argmax(-1)
            hit = ((q_logits.argmax(-1) == greedy) & in_vocab).float()
            for j in range(B - 1):  # keys independent of the data: every block position, every micro-batch
                metrics[f"acc_pos{j + 1}_sum"] = (hit * (k == j)).sum()
                metrics[f"acc_pos{j + 1}_count"] = (k == j).sum().float()
        return StepOutput(loss, weight, metrics)

    def tiled(self, batch: dict, models: Models) -> StepOutput:
        """The same loss with blocks tiling every row instead of random anchors (anchors 1, B, 2B-1, ...): each loss
        position t >= 1 is one block position exactly once, so there are loss_mask[:, 1:].sum() terms (Draft-OPD's
        kd_weight term on the data batch, whose count is needed before the loss)."""
        B = unwrap(models.draft).block_size
        lm = batch["loss_mask"].bool()
        R, T = lm.shape
        starts = torch.arange(1, max(T, 2), B - 1, device=lm.device)                         # (n,)
        anchors = starts.expand(R, -1).contiguous()
        sel = self._positions(lm, anchors, torch.ones_like(anchors, dtype=torch.bool), B)
        return self.block_terms(batch, models, anchors, sel)

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__["_calls"] = int(state.get("calls", 0))

    # ------------------------------------------------------------------------------------------- internals
    @staticmethod
    def _positions(lm: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, B: int) -> torch.Tensor:
        """(R, n, B-1) bool: block position k of anchor a has a loss iff loss_mask[a+k-1] (inside the row)."""
        T = lm.shape[1]
        at = anchors[..., None] + torch.arange(B - 1, device=lm.device)                       # (R, n, B-1)
        inside = at < T
        R = lm.shape[0]
        hit = lm[torch.arange(R, device=lm.device)[:, None, None], at.clamp(max=T - 1)] & inside
        return hit & valid[..., None]

    def _target(self, batch: dict, models: Models, rows: torch.Tensor, cols: torch.Tensor, t2d: torch.Tensor):
        """Features (R, T, D) the draft reads and, at the N selected positions over the draft vocabulary t2d (V,) bool:
        the target's logits restricted to it (N, Vd) (kd) or its greedy token as a draft id (N,) (ce), and whether the
        target's greedy token lies in it (N,) bool (always, for the full vocabulary)."""
        from specdistill.models.target import output_logits

        target = models.target
        full = bool(t2d.all())
        if "aux_hidden" in batch and "final_hidden" in batch:   # stored features (regenerated data, dump_features)
            features = batch["aux_hidden"]
            with torch.no_grad():
                h = batch["final_hidden"][rows, cols]                                              # (N, Ht)
                greedy = batch["target_argmax"][rows, cols] if "target_argmax" in batch else None   # (N,) | None
                if self.target == "ce" and greedy is not None:
                    p = None
                elif full or greedy is not None:
                    p = output_logits(target.model, h, rows=None if full else t2d)                 # (N, Vd): kept rows
                else:
                    p_all = output_logits(target.model, h)                                          # (N, V)
                    p, greedy = p_all[:, t2d], p_all.argmax(-1)
                if greedy is None:
                    greedy = p.argmax(-1)                                                            # full vocabulary
        else:
            out = target(batch["input_ids"], batch["attention_mask"])
            if out.aux_hidden is None:
                raise ValueError("the dflash objective needs the target's hidden states: build it with draft=dflash")
            features, p_all = out.aux_hidden, out.logits[rows, cols]                                # (N, V)
            p, greedy = p_all[:, t2d], p_all.argmax(-1)
        in_vocab = t2d[greedy]                                                                      # (N,)
        if self.target == "ce":
            to_draft = t2d.long().cumsum(0) - 1                                                     # (V,) draft id
            return features, None, to_draft[greedy].clamp(min=0), in_vocab
        return features, p, None, in_vocab
