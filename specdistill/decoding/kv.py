"""Batched decoding state: one model's KV cache over ragged rows (with per-row rollback), and ragged token lists.

Layout of BatchKV (B rows, S cache columns). A column holds one token slot for every row; `mask` (B, S) says which
slots are real (the attention mask), and a row's position ids count its real tokens. Rows start left-padded.
Each forward appends C columns for all rows (a "tail"); commit(keep) then says, per row, which tail slots survive:
  - columns after the last slot any row keeps are cropped (one slice per layer);
  - a row that kept fewer slots gets its rejected slots masked: holes that attention skips.
Keys and values already carry their rotary position, so a masked hole (or a moved column) leaves every later
forward exactly as if each row had its own dense cache: no recomputation, no re-feeding of accepted tokens.
Holes cost attention work, so when more than a quarter of the columns (and at least 32) are padding for the
widest row, compact() moves each row's real columns right (one gather) and drops the all-padding ones.
Needs full-attention layers: sliding windows count columns, not positions, so they are refused.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def logits_dim(model: torch.nn.Module) -> int:
    """Size of the model's output vocabulary (the logits' last dim), which may exceed the tokenizer's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear):
        return head.out_features
    return model.config.get_text_config().vocab_size


def max_positions(model: torch.nn.Module) -> int | None:
    config = model.config.get_text_config()
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


class BatchKV:
    """A causal LM plus its DynamicCache for B ragged rows; step() feeds tokens, commit() keeps some per row."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False) or type(layer).__name__ != "DynamicLayer":
                raise ValueError(f"{type(model).__name__} uses {type(layer).__name__} cache layers; speculative "
                                 "rollback here needs full-attention DynamicLayer caches (no sliding window)")
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self._keep_last_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.max_positions = max_positions(model)
        self.mask: torch.Tensor | None = None       # (B, S) long, 1 = real token slot
        self.length: torch.Tensor | None = None     # (B,) real tokens per row, tail included = next position id
        self.committed = 0                          # columns before the uncommitted tail
        self._committed_length: torch.Tensor | None = None  # (B,) real tokens per row before the tail

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
        """Feed a left-padded (B, T) batch (T may be 0) and commit its real tokens; returns the model output or None."""
        B = input_ids.shape[0]
        device = device_of(self.model)
        self.mask = torch.zeros(B, 0, dtype=torch.long, device=device)
        self.length = torch.zeros(B, dtype=torch.long, device=device)
        self._committed_length = self.length
        self.committed = 0
        if input_ids.shape[1] == 0:
            return None
        out = self.step(input_ids, attention_mask.bool(), **self._keep_last_logits, **kwargs)
        self.commit_all()  # left padding stays as masked columns
        return out

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, **kwargs):
        """Append (B, C) tokens; valid (B, C) bool marks the real ones (others are masked padding slots)."""
        device = device_of(self.model)
        input_ids = input_ids.to(device)
        valid = torch.ones_like(input_ids, dtype=torch.bool) if valid is None else valid.to(device)
        positions = self.length[:, None] + valid.long().cumsum(1) - 1      # (B, C); padding repeats a position
        # Clamping only touches tokens past the row's budget: their outputs are never used, and they are not kept.
        positions = positions.clamp(0, None if self.max_positions is None else self.max_positions - 1)
        self.mask = torch.cat([self.mask, valid.long()], dim=1)            # (B, S + C)
        out = self.model(input_ids=input_ids, attention_mask=self.mask, position_ids=positions,
                         use_cache=True, **{self._cache_kwarg: self.cache}, **kwargs)
        self.length = self.length + valid.sum(1)
        return out

    def commit_all(self) -> None:
        """Keep the whole tail as fed (no host sync)."""
        self.committed = self.mask.shape[1]
        self._committed_length = self.length

    @torch.no_grad()
    def commit(self, keep: torch.Tensor | None = None) -> None:
        """Keep, per row, the tail slots where keep (B, C) is True (default: all real ones); mask the rest.

        Per row, the kept slots must be a prefix of the row's real tail slots: a token's keys and values
        depend on every real token before it, so only a suffix can be dropped (a rejected draft and after).
        """
        S0, S = self.committed, self.mask.shape[1]
        real = self.mask[:, S0:].bool()                                     # (B, C)
        keep = real if keep is None else keep.to(real.device) & real
        kept_cols = torch.where(keep.any(0), torch.arange(S - S0, device=keep.device) + 1, 0)
        last = kept_cols.max() if S > S0 else kept_cols.new_zeros(())      # tail columns any row keeps
        count = keep.sum(1)                                                 # (B,)
        widest = (self.mask[:, :S0].sum(1) + count).max()                  # real tokens of the longest row
        last, widest = torch.stack([last, widest]).tolist()                # one host sync
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
                layer.keys, layer.values = layer.keys[:, :, : S0 + last], layer.values[:, :, : S0 + last]
        self.mask = torch.cat([self.mask[:, :S0], keep[:, :last].long()], dim=1)
        self.committed = S0 + last
        self.length = self._committed_length = self._committed_length + count
        if self.committed - widest > max(32, self.committed // 4):
            self.compact(widest)

    @torch.no_grad()
    def compact(self, widest: int | None = None) -> None:
        """Right-align every row's real columns (order kept) and drop the columns that are padding for all rows."""
        real = self.mask.bool()                                             # (B, S), no uncommitted tail here
        widest = int(real.sum(1).max()) if widest is None else widest
        order = torch.sort(real.int(), dim=1, stable=True).indices[:, real.shape[1] - widest:]  # (B, widest)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
                idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
                layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)  # (B, H, widest, D)
        self.mask = real.gather(1, order).long()
        self.committed = widest


class TokenBuffer:
    """Ragged per-row token lists in one (B, capacity) tensor, left-aligned; append() is one scatter."""

    def __init__(self, batch: int, capacity: int, device: torch.device, fill: int = 0):
        self.fill = fill
        self._data = torch.full((batch, capacity + 1), fill, dtype=torch.long, device=device)  # last col: trash
        self.length = torch.zeros(batch, dtype=torch.long, device=device)  # (B,)
        self._upper = 0  # host-side bound on length.max(), so growing needs no sync

    @classmethod
    def from_prompt(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, extra: int = 256, fill: int = -1):
        B, T = input_ids.shape
        buf = cls(B, T + extra, input_ids.device, fill)
        order = torch.sort(attention_mask.long(), dim=1, descending=True, stable=True).indices  # real tokens first
        tokens = input_ids.gather(1, order)
        buf.length = attention_mask.long().sum(1)
        real = torch.arange(T, device=input_ids.device) < buf.length[:, None]
        buf._data[:, :T] = torch.where(real, tokens, fill)
        buf._upper = T
        return buf

    @property
    def tokens(self) -> torch.Tensor:
        return self._data[:, :-1]  # (B, capacity)

    def append(self, new: torch.Tensor, count: torch.Tensor) -> None:
        """Append the first count[b] tokens of new[b] (B, C) to row b."""
        B, C = new.shape
        capacity = self._data.shape[1] - 1
        if self._upper + C > capacity:
            grow = max(capacity, C)
            pad = torch.full((B, grow), self.fill, dtype=torch.long, device=self._data.device)
            self._data = torch.cat([self._data[:, :-1], pad, self._data[:, -1:]], dim=1)
            capacity += grow
        col = torch.arange(C, device=new.device)
        idx = torch.where(col < count[:, None], self.length[:, None] + col, capacity)  # unwritten -> trash column
        self._data.scatter_(1, idx, new)
        self.length = self.length + count
        self._upper += C
