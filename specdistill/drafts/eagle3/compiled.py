"""The EAGLE-3 head's one-token draft steps as graphs compiled once, for `eval.compile=true` (CacheMode.compile).

A chain round drafts gamma tokens: the pending block (eager: its width changes from round to round), then gamma - 1
steps that each feed one token per row. Eager, each such step is a hundred-odd small kernels (the layer, its mask,
the readout), launched one by one from the host; on a GPU that launch cost, not the head's arithmetic, is most of a
round. Here those steps run as one graph per (batch bucket, cache columns), CUDA graphs on CUDA, on the same
building blocks as the target's compiled decode steps (decoding/compiled.py):
  - the head's cache is a SlotCache(fixed=True) of the bucket's rows and the run's column count, kept from call to
    call with its graphs (a slot), its buffers marked as fixed addresses;
  - the step's inputs (token, feature, position, the keys each row may see) are persistent buffers written in place,
    the new key and value are written at a device scalar column, and attention reads every column, masked;
  - each graph has a code object of its own and replays under fail_on_recompile (decoding.RecompileError);
  - its compiles are counted in decoding.compile_stats(head), which gpu_check and the evaluator read.
The arithmetic is the eager step's (Eagle3Head.step with n = 1): the same masked scores and fp32 softmax, over
columns the eager step does not have, whose weight is exactly zero.
"""

from __future__ import annotations

import math
import weakref

import torch

from specdistill.decoding.compiled import (CompileStats, GraphKey, RecompileError, attach, batch_bucket, call_graph,
                                           counting_backend, own_code, run_length)

from .model import Eagle3Head, SlotCache


def _draft_step(head: Eagle3Head, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
                allow: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, write_at: torch.Tensor):
    """tokens (R, 1), g (R, 1, H), positions (R, 1), allow (R, 1, 1, S) bool, keys / values (R, nh, S, hd), write_at
    () long -> h (R, 1, H), logits (R, Vd). Writes the new key and value at column write_at."""
    scale = 1.0 / math.sqrt(head.config.head_dim)

    def attend(q, k, v):
        at = write_at + torch.arange(1, device=k.device)
        keys.index_copy_(2, at, k)
        values.index_copy_(2, at, v)
        s = (q @ keys.transpose(-1, -2)) * scale
        s = s.masked_fill(~allow, torch.finfo(s.dtype).min)
        return s.float().softmax(-1).to(q.dtype) @ values

    h, _, _ = head._layer(tokens, g, positions, attend)
    return h, head.readout(h)[:, 0]


class HeadSlot:
    """One bucket's fixed cache and step buffers, and the graph compiled on them."""

    def __init__(self, head: Eagle3Head, bucket: int, length: int, index: int):
        c = head.config
        device, dtype = head.fc.weight.device, head.fc.weight.dtype
        self.bucket, self.length, self.index = bucket, length, index
        self.cache = SlotCache(bucket, c.num_attention_heads, c.head_dim, device, dtype, capacity=length, fixed=True)
        self.write_at = torch.zeros((), dtype=torch.long, device=device)
        self.tokens = torch.zeros(bucket, 1, dtype=torch.long, device=device)
        self.g = torch.zeros(bucket, 1, c.hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(bucket, 1, dtype=torch.long, device=device)
        self.allow = torch.zeros(bucket, 1, 1, length, dtype=torch.bool, device=device)
        for t in (self.cache.keys, self.cache.values, self.write_at, self.tokens, self.g, self.positions, self.allow):
            torch._dynamo.mark_static_address(t)
        self.key = GraphKey(bucket, 1, None, True, length, index)
        self.fn = None
        self.calls = 0
        self.busy = False


class CompiledHead:
    """A head's compiled draft steps: its slots (one per batch bucket at the run's column count) and counters."""

    def __init__(self, head: Eagle3Head, backend: str):
        self.head = weakref.ref(head)
        self.backend = backend
        self.device = head.fc.weight.device
        self.stats = CompileStats(model=type(head).__name__, backend=backend)
        self.length: int | None = None
        self.slots: list[HeadSlot] = []

    def acquire(self, rows: int, need: int) -> HeadSlot:
        """A free slot of rows' bucket holding at least `need` columns (the run's count: the first call's need
        rounded up to 256, doubled when a later call needs more)."""
        if self.length is None or need > self.length:
            self.length = max(run_length(need), 2 * self.length if self.length else 0)
            self.slots = [s for s in self.slots if s.busy]
            self.stats.cache_lengths.append(self.length)
        bucket = batch_bucket(rows)
        mine = [s for s in self.slots if s.bucket == bucket and s.length == self.length]
        slot = next((s for s in mine if not s.busy), None)
        if slot is None:
            slot = HeadSlot(self.head(), bucket, self.length, index=len(mine))
            self.slots.append(slot)
        slot.busy = True
        slot.cache.reset(rows)
        return slot

    def release(self, slot: HeadSlot) -> None:
        slot.busy = False
        if slot.length != self.length:
            self.slots = [s for s in self.slots if s is not slot]

    def step(self, slot: HeadSlot, token: torch.Tensor, g: torch.Tensor, position: torch.Tensor,
             key_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step of the slot's B real rows: token (B,), g (B, 1, H), position (B,), key_mask (B, W) bool
        the cached and drafted columns each row sees before this step's (W = the cache's length). Appends the step's
        slot to the cache; returns h (B, 1, H) and logits (B, Vd), copied out of the graph's buffers."""
        cache = slot.cache
        B, W = key_mask.shape
        if W != cache.length or W >= slot.length:
            raise ValueError(f"compiled draft step: key mask of {W} columns against a cache of {cache.length} used of "
                             f"{slot.length}")
        slot.tokens[:B, 0] = token
        slot.g[:B] = g
        slot.positions[:B, 0] = position
        slot.allow.zero_()
        slot.allow[:B, 0, 0, :W] = key_mask
        slot.allow[:B, 0, 0, W] = True
        slot.write_at.fill_(W)
        if slot.fn is None:
            slot.fn = torch.compile(own_code(_draft_step, f"eagle3_draft_step_{slot.key}"), fullgraph=True,
                                    backend=counting_backend(self.backend, self.device, self.stats, str(slot.key)))
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were copied out
        h, logits = call_graph(self.stats, str(slot.key), slot.calls == 0, slot.fn, self.head(), slot.tokens, slot.g,
                               slot.positions, slot.allow, cache.keys, cache.values, slot.write_at)
        slot.calls += 1
        cache.length = W + 1
        return h[:B].clone(), logits[:B].clone()


def compiled_head(head: Eagle3Head, backend: str) -> CompiledHead:
    """The head's CompiledHead (made anew for another backend), registered where decoding.compile_stats finds it."""
    from specdistill.decoding.compiled import decoding_of

    compiled = decoding_of(head)
    if not isinstance(compiled, CompiledHead) or compiled.backend != backend:
        compiled = CompiledHead(head, backend)
        attach(head, compiled)
    return compiled


__all__ = ["CompiledHead", "HeadSlot", "RecompileError", "compiled_head"]
