"""Draft vocabularies: which target ids a reduced-vocabulary draft predicts, the id maps a draft module keeps, and
target logits restricted to them. Shared by every draft kind (EAGLE-3 heads, DFlash drafts) and the target wrapper;
knows nothing about any kind's layers."""
from __future__ import annotations

import torch


class DraftVocabMaps:
    """The id maps of a draft module whose output vocabulary (Vd ids) may be smaller than the target's (V), as
    buffers: d2t (Vd,) long offsets (target id = draft id + d2t[draft id], as vLLM reads them) and t2d (V,) bool, the
    target ids kept. Mixed into an nn.Module, whose __init__ calls register_vocab_maps; the whole vocabulary until
    set_vocab says otherwise."""

    def register_vocab_maps(self, vocab_size: int, draft_vocab_size: int) -> None:
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.full((vocab_size,), draft_vocab_size == vocab_size, dtype=torch.bool))

    def set_vocab(self, kept: torch.Tensor) -> None:
        """Read out only the target ids `kept` (Vd,), ascending."""
        kept = kept.to(self.d2t.device).long()
        self.d2t.copy_(kept - torch.arange(len(kept), device=kept.device))
        self.t2d.zero_()
        self.t2d[kept] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def restrict_to_draft_vocab(p_logits: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits (..., V) -> logits over the draft vocabulary (..., Vd) (their softmax = p restricted to it and
    renormalised) and (...,) bool whether the target's argmax lies in the draft vocabulary (EAGLE-3 masks the
    positions where it does not). t2d: (V,) bool, the head's target-to-draft membership mask."""
    return p_logits[..., t2d], t2d[p_logits.argmax(-1)]


def frequent_token_vocab(rows, vocab_size: int, draft_vocab_size: int, rows_per_chunk: int = 1024) -> torch.Tensor:
    """The Vd most frequent next-token ids under the loss mask (ascending ids). rows: a column store (a
    datasets.Dataset, data.regenerated.RegeneratedStore: rows["input_ids"], rows["loss_mask"] are whole columns) or a
    list of {input_ids, loss_mask}; loss_mask[t] marks the prediction of input_ids[t+1].

    Beyond the data itself, memory is O(V + one chunk of rows) whatever the vocabulary (262k for Gemma-3): counts
    accumulate chunk by chunk in one (V,) int64 vector and the choice is one sort of it (nothing V x V, no list of
    every predicted token)."""
    if hasattr(rows, "column_names"):
        pairs = zip(rows["input_ids"], rows["loss_mask"])
    else:
        pairs = ((r["input_ids"], r["loss_mask"]) for r in rows)
    counts = torch.zeros(vocab_size, dtype=torch.long)  # (V,)
    chunk: list[torch.Tensor] = []
    for i, (ids, m) in enumerate(pairs, 1):
        if len(ids) > 1:  # position t counts iff loss_mask[t]: it predicts ids[t+1]
            chunk.append(torch.as_tensor(ids[1:], dtype=torch.long)[torch.as_tensor(m[:-1], dtype=torch.bool)])
        if chunk and (i % rows_per_chunk == 0):
            counts += torch.bincount(torch.cat(chunk), minlength=vocab_size)[:vocab_size]
            chunk = []
    if chunk:
        counts += torch.bincount(torch.cat(chunk), minlength=vocab_size)[:vocab_size]
    Vd = min(draft_vocab_size, vocab_size)
    # ties broken by id so the choice is deterministic; unseen tokens fill the tail in id order
    order = torch.argsort(counts * vocab_size + (vocab_size - 1 - torch.arange(vocab_size)), descending=True)
    return order[:Vd].sort().values
