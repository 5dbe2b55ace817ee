"""The EAGLE-3 head's forwards of a chain round as graphs compiled once, for `eval.compile=true` (CacheMode.compile).

A chain round drafts gamma tokens: the pending block (the slots the last verify forward produced, up to gamma + 1,
and the drafting slot), then gamma - 1 steps that each feed one token per row. Eager, each of these head forwards is
a hundred-odd small kernels (the layer, its mask, the readout), launched one by one from the host; on a GPU that
launch cost, not the head's arithmetic, is most of a round. Here they run as two graphs per (batch bucket, cache
columns, and under autocast per features' dtype), CUDA graphs on CUDA, on the same building blocks as the target's
compiled decode steps (decoding/compiled.py):
  - the one-token draft step, and the pending block padded to the widest block a round so far could leave (its drafts
    + 1; padding slots are seen by no slot and cropped at commit); a wider block (the prompt-long first one) runs
    eagerly on the same cache;
  - the head's cache is a SlotCache(fixed=True) of the bucket's rows and the run's column count, kept from call to
    call with its graphs (a slot of a decoding.SlotPool), its buffers marked as fixed addresses; a row that stops
    keeps its place (rows are not dropped while compiled);
  - the steps' inputs (tokens, features, positions, the columns each row sees, the slot read out) are persistent
    buffers written in place, the new keys and values are written at a device scalar column, and attention reads
    every column, masked by decoding.compiled.column_mask (causal AND seen, built in the graph);
  - each graph has a code object of its own and replays under fail_on_recompile (decoding.RecompileError);
  - its compiles are counted in decoding.compile_stats(head), which gpu_check and the evaluator read.
The arithmetic is the eager step's (Eagle3Head.step): the same masked scores and fp32 softmax, over columns the eager
step does not have, whose weight is exactly zero.
"""

from __future__ import annotations

import math
import weakref

import torch

from specdistill.decoding.compiled import (CompileStats, GraphKey, RecompileError, SlotPool, attach, call_graph,
                                           column_mask, counting_backend, first_rows, own_code)

from .model import Eagle3Head, SlotCache


def _attend_fixed(keys: torch.Tensor, values: torch.Tensor, write_at: torch.Tensor, seen: torch.Tensor,
                  scale: float):
    """Eagle3Head._layer's attend(q, k, v) on a fixed cache: the n new keys and values written at columns write_at ..
    write_at + n - 1, then attention of new slot i over the columns j <= write_at + i that seen (R, S) marks, as
    Eagle3Head.step attends (the same masked scores and fp32 softmax; columns it would not have get weight exactly
    zero)."""

    def attend(q, k, v):
        at = write_at + torch.arange(k.shape[2], device=k.device)
        keys.index_copy_(2, at, k.to(keys.dtype))  # as SlotCache.append's assignment casts
        values.index_copy_(2, at, v.to(values.dtype))
        allow = column_mask(seen, write_at, k.shape[2])                     # (R, 1, n, S)
        s = (q @ keys.transpose(-1, -2)) * scale
        s = s.masked_fill(~allow, torch.finfo(s.dtype).min)
        return s.float().softmax(-1).to(q.dtype) @ values

    return attend


def _draft_step(head: Eagle3Head, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
                seen: torch.Tensor, readout: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                write_at: torch.Tensor):
    """tokens (R, n), g (R, n, H), positions (R, n), seen (R, S) bool, readout (R,) long, keys / values
    (R, nh, S, hd), write_at () long -> h (R, 1, H) and logits (R, Vd) at slot readout of each row. Writes the n new
    keys and values at columns write_at ..; n = 1: a draft step, n > 1: a round's pending block, padded."""
    attend = _attend_fixed(keys, values, write_at, seen, 1.0 / math.sqrt(head.config.head_dim))
    h, _, _ = head._layer(tokens, g, positions, attend)
    h = h[torch.arange(h.shape[0], device=h.device), readout][:, None]  # (R, 1, H)
    return h, head.readout(h)[:, 0]


class HeadGraph:
    """One step shape's input buffers (fixed addresses, written in place) and its graph, compiled at its first call."""

    def __init__(self, slot: "HeadSlot", width: int, hidden: int, dtype, device):
        R, L = slot.bucket, slot.length
        kind = "draft" if width == 1 else "pending"
        dtype_tag = "" if dtype == slot.dtype else f"_{str(dtype).removeprefix('torch.')}"
        self.name = f"{kind}_{GraphKey(R, width, None, True, L, slot.index)}{dtype_tag}"
        self.width = width
        self.tokens = torch.zeros(R, width, dtype=torch.long, device=device)
        self.g = torch.zeros(R, width, hidden, dtype=dtype, device=device)
        self.positions = torch.zeros(R, width, dtype=torch.long, device=device)
        self.seen = torch.ones(R, L, dtype=torch.bool, device=device)  # dummy rows see every column before theirs
        #                                                                 (HeadSlot.start resets them)
        self.readout = torch.zeros(R, dtype=torch.long, device=device)
        for t in (self.tokens, self.g, self.positions, self.seen, self.readout):
            torch._dynamo.mark_static_address(t)
        self.fn = None
        self.calls = 0


class HeadSlot:
    """One bucket's fixed cache, and the graphs compiled on it: the one-token draft step, the pending block's."""

    def __init__(self, head: Eagle3Head, bucket: int, length: int, index: int):
        c = head.config
        self.device, self.dtype, self.hidden = head.fc.weight.device, head.fc.weight.dtype, c.hidden_size
        self.bucket, self.length, self.index = bucket, length, index
        self.cache = SlotCache(bucket, c.num_attention_heads, c.head_dim, self.device, self.dtype, capacity=length,
                               fixed=True)
        self.write_at = torch.zeros((), dtype=torch.long, device=self.device)
        for t in (self.cache.keys, self.cache.values, self.write_at):
            torch._dynamo.mark_static_address(t)
        self.graphs: dict[tuple, HeadGraph] = {}  # by (width, features' dtype): 1 (draft steps), the pending block's
        self.pending_width = 0                    # the widest pending graph so far
        self.busy = False
        self.lease = 0  # counts acquires and releases: a finalizer frees only the lease it was made for

    def start(self, rows: int) -> None:
        """A new decoding of `rows` real rows: the cache empty (stale columns stay, masked), and the dummy rows past
        them seeing every column again (their seen rows keep what an earlier, wider call wrote)."""
        self.cache.reset(rows)
        for graph in self.graphs.values():
            graph.seen[rows:].fill_(True)

    def graph(self, width: int, dtype: torch.dtype) -> HeadGraph:
        """The graph of `width` slots whose features come in `dtype` (the head's, or autocast's under autocast, as
        the eager step's residual stream has it)."""
        if (width, dtype) not in self.graphs:
            self.graphs[width, dtype] = HeadGraph(self, width, self.hidden, dtype, self.device)
        return self.graphs[width, dtype]


class CompiledHead(SlotPool):
    """A head's compiled steps: its slots (one per batch bucket at the run's column count) and counters."""

    def __init__(self, head: Eagle3Head, backend: str):
        self.head = weakref.ref(head)
        self.backend = backend
        self.device, self.dtype = head.fc.weight.device, head.fc.weight.dtype
        super().__init__(CompileStats(model=type(head).__name__, backend=backend))

    def new_slot(self, bucket: int, length: int, index: int) -> HeadSlot:
        return HeadSlot(self.head(), bucket, length, index)

    def pending_width(self, slot: HeadSlot, width: int, drafts: int) -> int | None:
        """The width a pending block of `width` slots runs at compiled, or None: eagerly (wider than the round can
        leave, as a prompt-long first block is). A round of `drafts` drafts leaves at most drafts + 1 slots; the
        slot's pending graph is the widest such round's so far (a wider round compiles one more, at most one per
        draft length)."""
        slot.pending_width = max(slot.pending_width, drafts + 1)
        return slot.pending_width if width <= slot.pending_width else None

    def run(self, slot: HeadSlot, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
            seen: torch.Tensor | None, readout: torch.Tensor | None,
            width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One compiled head forward of the slot's B real rows at width n (1, or the pending graph's): tokens (B, P),
        g (B, P, H), positions (B, P) of the P <= n slots fed (width: n, when the block is padded: the padding slots
        keep whatever the buffers hold, are seen by no slot fed and cropped at commit), seen (B, >= W + P) bool the
        columns the slots may see (W = the cache's length, the slots' own columns next; slot i sees those up to its
        own, so columns past W + P may be written ahead), readout (B,) long the slot each row reads out. seen or
        readout None: the graph's buffer holds them already (the round's later draft steps: their columns written by
        the first, slot 0 always). Appends the n slots to the cache; returns h (B, 1, H), a view of the graph's output
        that the next compiled run overwrites (the round feeds it to the next step at once), and logits (B, Vd) at
        each row's readout slot, copied out."""
        cache = slot.cache
        B, P = tokens.shape
        n = width or P
        W = cache.length
        if P > n or W + n > slot.length or (seen is not None and not W + P <= seen.shape[-1] <= slot.length):
            raise ValueError(f"compiled head step: {P} slots of {n} seeing {None if seen is None else seen.shape[-1]}"
                             f" columns against a cache of {W} used of {slot.length}")
        graph = slot.graph(n, g.dtype)

        def fed(buffer: torch.Tensor) -> torch.Tensor:  # the slots fed of the real rows
            buffer = first_rows(buffer, B)
            return buffer if P == n else buffer[:, :P]

        fed(graph.tokens).copy_(tokens)
        fed(graph.g).copy_(g)
        fed(graph.positions).copy_(positions)
        if seen is not None:  # the columns past seen's are never seen (causal): stale is fine
            first_rows(graph.seen, B)[:, : seen.shape[-1]].copy_(seen)
        if readout is not None:
            first_rows(graph.readout, B).copy_(readout)
        slot.write_at.fill_(W)
        if graph.fn is None:
            graph.fn = torch.compile(own_code(_draft_step, f"eagle3_{graph.name}"), fullgraph=True, dynamic=False,
                                     backend=counting_backend(self.backend, self.device, self.stats, graph.name))
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were copied out
        h, logits = call_graph(self.stats, graph.name, graph.calls == 0, graph.fn, self.head(), graph.tokens, graph.g,
                               graph.positions, graph.seen, graph.readout, cache.keys, cache.values, slot.write_at)
        graph.calls += 1
        cache.length = W + n
        return first_rows(h, B), first_rows(logits, B).clone()


def compiled_head(head: Eagle3Head, backend: str) -> CompiledHead:
    """The head's CompiledHead (made anew for another backend, or a head moved or cast since), registered where
    decoding.compile_stats finds it."""
    from specdistill.decoding.compiled import decoding_of

    compiled = decoding_of(head)
    if (not isinstance(compiled, CompiledHead) or compiled.backend != backend
            or (compiled.device, compiled.dtype) != (head.fc.weight.device, head.fc.weight.dtype)):
        compiled = CompiledHead(head, backend)
        attach(head, compiled)
    return compiled


__all__ = ["CompiledHead", "HeadGraph", "HeadSlot", "RecompileError", "compiled_head"]
