"""Compiled decode steps that compile once: one graph per (model, batch bucket, query width), fixed shapes throughout.

This module knows nothing of rows, holes or rollback (kv.BatchKV keeps those); it runs one decode forward of a model
on a static KV cache from inputs that BatchKV has already built (token ids, position ids, ready 4D masks).

What keeps torch._dynamo from recompiling (each of these, left varying, adds a guard failure and a cache entry):
  - the batch is padded up to a bucket (BATCH_BUCKETS) with dummy rows that attend to stale columns and are never
    read; the cache has the bucket's rows;
  - token-tree steps are padded up to a power-of-two width (width_bucket) with slots dropped after the forward;
  - each (bucket, query width, tree-tail width, hidden states or not) gets its own step function with its OWN code
    object: dynamo keeps compiled entries, and counts recompiles against its limit, per code object, so one graph per
    code object never meets the limit, and a new model gets new code objects (nothing carried over from the last);
  - the step's inputs are persistent contiguous buffers written in place (input ids, position ids, masks, the write
    column), and its kwarg set is fixed; a chain step of a full-attention model takes the columns each row sees
    (SeenColumns, (B, S)) and builds its 4D mask inside the graph (column_mask), so the host writes one small buffer
    instead of building the mask kernel by kernel;
  - the cache length is fixed per run (CacheMode.max_length, else the first call's need, doubled only when a later
    call needs more), not sized per call.
Every step after a graph's first runs under torch.compiler.set_stance("fail_on_recompile"): a guard that fails
raises RecompileError naming the graph and dynamo's reason, instead of compiling again or running eagerly. The
backend is wrapped to count its compiles (CompileStats), so a caller can check that each graph compiled exactly once.
On CUDA the inductor backend records CUDA graphs ("reduce-overhead"); outputs are copied out of the graph's buffers.
"""

from __future__ import annotations

import functools
import math
import re
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # beyond the last: multiples of it
MAX_GRAPHS = 64  # per model: more means a shape that is not bounded (a bug in the caller), refused by name


def batch_bucket(batch: int) -> int:
    """The padded batch size of a compiled step: the smallest bucket >= batch (multiples of 128 beyond 128)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    for bucket in BATCH_BUCKETS:
        if batch <= bucket:
            return bucket
    return math.ceil(batch / BATCH_BUCKETS[-1]) * BATCH_BUCKETS[-1]


def width_bucket(width: int) -> int:
    """The padded query width of a compiled token-tree step: the next power of two (chains keep their gamma + 1)."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    return 1 << (width - 1).bit_length()


def run_length(need: int, fixed: int | None = None) -> int:
    """A run's static cache length: `fixed` (the caller's, when it knows the run's longest call), else the call's
    need rounded up to a multiple of 256 (a later call that needs more doubles it: CompiledDecoding.acquire)."""
    if fixed is not None:
        if fixed < need:
            raise ValueError(f"CacheMode(max_length={fixed}) is shorter than this call needs ({need} columns: the "
                             "prompt, max_new_tokens and one round): raise max_length or leave it None")
        return fixed
    return 256 * math.ceil(need / 256)


class RecompileError(RuntimeError):
    """A compiled decode step met inputs its graph was not compiled for (dynamo would recompile)."""


def first_rows(buffer: torch.Tensor, rows: int) -> torch.Tensor:
    """A graph buffer's first `rows` rows (the real rows of a batch bucket): the buffer itself when it has no more, so
    no view is made (one host operator fewer per write)."""
    return buffer if rows == buffer.shape[0] else buffer[:rows]


# ----------------------------------------------------------------------------------------------- masks in the graph
def column_mask(seen: torch.Tensor, write_at: torch.Tensor, width: int,
                dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """The 4D mask of `width` queries written at columns write_at .. write_at + width - 1: query i sees column j when
    seen[r, j] and j <= write_at + i (causal AND padding, by cache column, as transformers' masks for a full-attention
    layer). seen (R, L) bool, write_at () long -> (R, 1, width, L): bool (True: attend), or for a float dtype additive
    (0 where seen, the dtype's min elsewhere). Traceable with fixed shapes: compiled steps build their masks with it."""
    L = seen.shape[1]
    query_col = write_at + torch.arange(width, device=seen.device)                  # (width,)
    causal = torch.arange(L, device=seen.device) <= query_col[:, None]             # (width, L)
    allow = seen[:, None, None, :] & causal                                         # (R, 1, width, L)
    if dtype == torch.bool:
        return allow
    return torch.zeros(allow.shape, dtype=dtype, device=seen.device).masked_fill(~allow, torch.finfo(dtype).min)


@dataclass
class SeenColumns:
    """A compiled chain step's mask given as the columns each real row sees: seen (B, S) (S: the columns in use, the
    step's own included); the graph builds the 4D mask (column_mask) in the format of MaskFormat."""

    seen: torch.Tensor


@dataclass(frozen=True)
class MaskFormat:
    """How a model takes its 4D masks: their dtype (bool, or a float for additive masks), and the layer types of a
    config that lists them (a dict of one mask per type, all alike for full attention), or None (one mask)."""

    dtype: torch.dtype
    layer_types: tuple[str, ...] | None

    @staticmethod
    def learn(built, seen: torch.Tensor, width: int) -> "MaskFormat | None":
        """The format that gives `built` (what the model's mask function built for a step of `width` queries: 4D
        (B, 1, width, L), or a dict of them), or None where column_mask cannot reproduce it exactly: seen (B, S) the
        columns in use."""
        masks = built if isinstance(built, dict) else {None: built}
        first = next(iter(masks.values()))
        if not all(isinstance(m, torch.Tensor) and m.dim() == 4 and torch.equal(m, first) for m in masks.values()):
            return None
        if first.dtype != torch.bool and not first.dtype.is_floating_point:
            return None
        B, _, C, L = first.shape
        write_at = torch.tensor(seen.shape[1] - width, device=seen.device)
        padded = torch.nn.functional.pad(seen.bool(), (0, L - seen.shape[1]))
        if (C != width or seen.shape[0] != B
                or not torch.equal(column_mask(padded, write_at, width, first.dtype), first)):
            return None
        return MaskFormat(first.dtype, tuple(masks) if isinstance(built, dict) else None)

    def build(self, seen: torch.Tensor, write_at: torch.Tensor, width: int):
        mask = column_mask(seen, write_at, width, self.dtype)
        return mask if self.layer_types is None else {t: mask for t in self.layer_types}


# ----------------------------------------------------------------------------------------------- the cache layer
class ColumnLayer(CacheLayerMixin):
    """One attention layer's keys and values, preallocated to `length` columns (B rows, lazily at the first update).

    Eager forwards write the new columns at host column `start` and get back the used columns [0, start): the same
    width a growing cache returns, so a static cache attends to no more columns than a growing one. Compiled
    forwards (traced by dynamo) write at the device scalar `write_at` and get back every column (fixed shape), their
    masks covering the unused ones. BatchKV keeps `start` right: rollback() / crop() move it back; write_at is set
    before each compiled step. Built on transformers' CacheLayerMixin (the interface a Cache's layers implement);
    get_mask_sizes takes a query length or a cache_position tensor, as transformers 5.x releases pass either."""

    is_compileable = True
    is_croppable = True
    is_sliding = False

    def __init__(self, length: int, static_address: bool = False, rows: int | None = None):
        super().__init__()
        self.max_cache_len = length
        self.rows = rows                       # the cache's rows (a batch bucket); None: the first update's
        self.start = 0                         # host: columns in use (the next eager write goes here)
        self.write_at: torch.Tensor | None = None  # () long on the device: the next compiled write (shared by layers)
        self.static_address = static_address   # mark keys / values as fixed-address graph inputs (CUDA graphs)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        B, H, _, D = key_states.shape
        B = self.rows or B
        value_states = key_states if value_states is None else value_states
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = key_states.new_zeros(B, H, self.max_cache_len, D)
        self.values = value_states.new_zeros(B, value_states.shape[1], self.max_cache_len, value_states.shape[-1])
        if self.static_address and not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        C = key_states.shape[-2]
        if torch.compiler.is_compiling():  # a compiled step: every row of the bucket, fixed shapes
            at = self.write_at + torch.arange(C, device=key_states.device)   # (C,)
            self.keys.index_copy_(2, at, key_states)
            self.values.index_copy_(2, at, value_states)
            return self.keys, self.values
        if self.start + C > self.max_cache_len:
            raise ValueError(f"static KV cache of {self.max_cache_len} columns overflows ({self.start} used, {C} fed)")
        keys, values = self.keys, self.values
        if key_states.shape[0] != keys.shape[0]:                           # B real rows of a bucket's cache
            keys, values = keys[: key_states.shape[0]], values[: key_states.shape[0]]
        keys.narrow(2, self.start, C).copy_(key_states)
        values.narrow(2, self.start, C).copy_(value_states)
        self.start += C
        return keys.narrow(2, 0, self.start), values.narrow(2, 0, self.start)

    def get_mask_sizes(self, query, *args, **kwargs) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next eager forward (the used columns after its write)."""
        q = query if isinstance(query, int) else int(query.shape[0])
        return self.start + q, 0

    def get_seq_length(self, *args, **kwargs):
        return self.write_at if torch.compiler.is_compiling() else self.start

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def crop(self, max_length: int) -> None:
        """transformers' crop protocol: a negative value drops that many columns off the end, else keep max_length."""
        self.start = self.start + max_length if max_length < 0 else min(self.start, max_length)


def static_cache(num_layers: int, length: int, static_address: bool = False, rows: int | None = None) -> Cache:
    return Cache(layers=[ColumnLayer(length, static_address, rows) for _ in range(num_layers)])


# ----------------------------------------------------------------------------------------------- counters
@dataclass(frozen=True)
class GraphKey:
    """What one compiled graph is specialized to."""

    batch: int          # the batch bucket (rows of the cache and of every input)
    width: int          # query tokens per row (1 for a plain step, gamma + 1 for a verification)
    tail: int | None    # token trees: uncommitted tail columns the tree mask covers (None: a chain)
    hidden: bool        # the step returns hidden states (output_hidden_states=True)
    length: int         # cache columns
    slot: int = 0       # which of the model's caches of this bucket (two live decodings of one model: 0 and 1)
    seen: bool = False  # the mask comes as SeenColumns, built in the graph (a model's chain steps always or never)

    def __str__(self) -> str:
        tail = "" if self.tail is None else f"_tail{self.tail}"
        slot = "" if self.slot == 0 else f"_slot{self.slot}"
        return f"batch{self.batch}_width{self.width}{tail}{'_hidden' if self.hidden else ''}_len{self.length}{slot}"


@dataclass
class CompileStats:
    """Compiles of one model's compiled decoding, per graph. compiles[g] == 1 for every graph g is the goal: each
    (batch bucket, width) compiled once and replayed. A second compile of a graph raises RecompileError (so
    recompiles stays 0 unless a caller catches it); cache_lengths lists each run length used (more than one: a
    later call needed a longer cache, and its graphs compiled anew)."""

    model: str = ""
    backend: str = ""
    compiles: dict[str, int] = field(default_factory=dict)  # graph (GraphKey string) -> backend compiles
    calls: dict[str, int] = field(default_factory=dict)     # graph -> compiled steps run
    cache_lengths: list[int] = field(default_factory=list)

    @property
    def total_compiles(self) -> int:
        return sum(self.compiles.values())

    @property
    def recompiles(self) -> int:
        return sum(n - 1 for n in self.compiles.values() if n > 1)

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def by_bucket(self) -> dict[int, int]:
        """Batch bucket -> compiles of its graphs."""
        out: dict[int, int] = {}
        for name, n in self.compiles.items():  # "batch4_width1_len256", or a kind's "draft_batch4_..."
            bucket = int(re.search(r"(?:^|_)batch(\d+)_", name).group(1))
            out[bucket] = out.get(bucket, 0) + n
        return dict(sorted(out.items()))

    def as_dict(self) -> dict:
        """JSON-ready: totals, per bucket and per graph."""
        return {"model": self.model, "backend": self.backend, "total_compiles": self.total_compiles,
                "recompiles": self.recompiles, "graphs": len(self.compiles), "total_calls": self.total_calls,
                "by_bucket": {str(k): v for k, v in self.by_bucket().items()}, "compiles": dict(self.compiles),
                "calls": dict(self.calls), "cache_lengths": list(self.cache_lengths)}


# ----------------------------------------------------------------------------------------------- graphs
def _backend(name: str, device: torch.device, count: Callable[[], None]) -> Callable:
    """A torch.compile backend that counts its compiles. "inductor": what torch.compile(mode=...) runs (inductor's
    compile_fx with the mode's options, a torch internal that torch.compile itself calls), "reduce-overhead" (CUDA
    graphs) on CUDA; other names: dynamo's registered backends ("eager", "aot_eager": tests of the guards)."""
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        mode = "reduce-overhead" if device.type == "cuda" else "default"
        inner = functools.partial(compile_fx, config_patches=torch._inductor.list_mode_options(mode))
    else:
        inner = torch._dynamo.lookup_backend(name)

    def backend(gm, example_inputs):
        count()
        return inner(gm, example_inputs)

    return backend


def counting_backend(name: str, device: torch.device, stats: "CompileStats", graph: str) -> Callable:
    """_backend counting each compile of `graph` in stats.compiles."""
    def count() -> None:
        stats.compiles[graph] = stats.compiles.get(graph, 0) + 1

    return _backend(name, device, count)


def own_code(fn: Callable, name: str) -> Callable:
    """fn with a code object of its own: dynamo keeps its compiled entries (and its recompile count) per code object."""
    code = fn.__code__
    code = code.replace(**{k: name for k in ("co_name", "co_qualname") if hasattr(code, k)})
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


_GRAPH_RUNS = [0]  # compiled graphs run so far in this process: GraphStates tells stale outputs by it


def call_graph(stats: "CompileStats", graph: str, first: bool, fn: Callable, *args):
    """Run a compiled graph: its first call compiles (the backend must run exactly once), later ones must not (a
    guard that fails raises RecompileError instead of compiling again or running eagerly)."""
    stats.calls[graph] = stats.calls.get(graph, 0) + 1
    _GRAPH_RUNS[0] += 1
    if first:
        out = fn(*args)
        if stats.compiles.get(graph, 0) != 1:
            raise RecompileError(f"compiled decoding of {stats.model}: graph {graph} compiled "
                                 f"{stats.compiles.get(graph, 0)} times on its first call (expected 1): "
                                 "torch.compile ran it eagerly or split it; see TORCH_LOGS=graph_breaks")
        return out
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            return fn(*args)
    except RuntimeError as err:
        if "fail_on_recompile" not in str(err):
            raise
        raise RecompileError(f"compiled decoding of {stats.model} would recompile graph {graph}: {err}") from err


def _step_function(cache: Cache, cache_kwarg: str, hidden: bool, write_at: torch.Tensor,
                   takes_cache_position: bool, mask_format: MaskFormat | None = None) -> Callable:
    """The decode step: one forward, a fixed kwarg set (cache_position only for models whose forward takes it). The
    model is an argument, not a closure cell: the step holds no reference that would keep a dropped model alive.
    mask_format: attention_mask is the (bucket, length) columns each row sees, made into the model's 4D masks here."""

    def decode_step(model, input_ids, position_ids, attention_mask):
        if mask_format is not None:
            attention_mask = mask_format.build(attention_mask, write_at, input_ids.shape[1])
        extra = {}
        if takes_cache_position:
            extra["cache_position"] = write_at + torch.arange(input_ids.shape[1], device=input_ids.device)
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=True,
                    output_hidden_states=hidden, **{cache_kwarg: cache}, **extra)
        return out.logits, (tuple(out.hidden_states) if hidden else ())

    return decode_step


class GraphStates(Sequence):
    """A compiled step's hidden states, per layer (B, C, H) for the real rows, each copied out of the graph's buffers
    the first time it is read: a round reads the few layers its drafter and feature capture use (an EAGLE-3 head:
    three of a 32-layer target's 33), not all. A layer first read after any compiled graph ran again (CUDA graphs
    may then have reused its memory) raises instead of returning what the buffers hold."""

    def __init__(self, states: tuple[torch.Tensor, ...], rows: int):
        self._states, self._rows, self._run = states, rows, _GRAPH_RUNS[0]
        self._copies: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(len(self))[i])
        i = range(len(self))[i]
        if i not in self._copies:
            if _GRAPH_RUNS[0] != self._run:
                raise RuntimeError("a compiled step's hidden state read after a compiled graph ran again (CUDA "
                                   "graphs reuse their output memory): read the layers a round needs before its next "
                                   "compiled forward")
            self._copies[i] = self._states[i][: self._rows].clone()
        return self._copies[i]


@dataclass
class DecodeOutput:
    """A compiled step's outputs for the real rows, owned by the caller (copied out of the graph's buffers)."""

    logits: torch.Tensor                          # (B, C, V)
    hidden_states: GraphStates | None = None      # per layer (B, C, H) where asked for, copied when read


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """A mask of mask's shape and dtype that lets every query see every key (dummy rows): True, or 0 added."""
    return torch.ones_like(mask) if mask.dtype == torch.bool else torch.zeros_like(mask)


class _Graph:
    """One compiled step and its persistent input buffers."""

    def __init__(self, fn: Callable, input_ids: torch.Tensor, positions: torch.Tensor, masks):
        self.fn, self.input_ids, self.positions, self.masks = fn, input_ids, positions, masks
        self.calls = 0
        for t in self._buffers():
            torch._dynamo.mark_static_address(t)

    def _buffers(self) -> list[torch.Tensor]:
        masks = list(self.masks.values()) if isinstance(self.masks, dict) else [self.masks]
        return [self.input_ids, self.positions, *masks]

    def write(self, input_ids: torch.Tensor, positions: torch.Tensor, masks) -> None:
        """Real rows' inputs into the first B rows of the buffers (dummy rows keep what they hold). SeenColumns go
        into the first S columns of the (bucket, length) buffer: the columns past S are never seen (causal)."""
        B = input_ids.shape[0]
        first_rows(self.input_ids, B).copy_(input_ids)
        first_rows(self.positions, B).copy_(positions)
        if isinstance(masks, SeenColumns):
            first_rows(self.masks, B)[:, : masks.seen.shape[1]].copy_(masks.seen)
        elif isinstance(masks, dict):
            for name, m in masks.items():
                first_rows(self.masks[name], B).copy_(m)
        else:
            first_rows(self.masks, B).copy_(masks)


class _Slot:
    """A static cache of one bucket and the graphs compiled on it (they replay on its tensors)."""

    def __init__(self, decoding: "CompiledDecoding", bucket: int, length: int, index: int):
        self.decoding, self.bucket, self.length, self.index = decoding, bucket, length, index
        self.cache = static_cache(decoding.num_layers, length, static_address=True, rows=bucket)
        self.write_at = torch.zeros((), dtype=torch.long, device=decoding.device)
        torch._dynamo.mark_static_address(self.write_at)
        for layer in self.cache.layers:
            layer.write_at = self.write_at
        self.graphs: dict[GraphKey, _Graph] = {}
        self.busy = False
        self.lease = 0  # counts acquires and releases: a finalizer frees only the lease it was made for

    @property
    def ready(self) -> bool:
        """Every layer allocated (an eager forward did it): compiled steps never allocate."""
        return all(layer.is_initialized for layer in self.cache.layers)

    def start(self, rows: int) -> None:
        """A new decoding of `rows` real rows: every layer empty (stale columns stay, masked), and the dummy rows past
        them seeing every column again (a seen buffer's rows keep what an earlier, wider call wrote)."""
        for layer in self.cache.layers:
            layer.start = 0
        self.rows = rows
        for key, graph in self.graphs.items():
            if key.seen:
                graph.masks[rows:].fill_(True)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, masks, hidden: bool,
            tail: int | None) -> DecodeOutput:
        """input_ids, positions (B, C); masks: 4D (B, 1, C, length) or a dict of them per layer type, or SeenColumns
        (the graph builds the mask)."""
        B, C = input_ids.shape
        column = self.cache.layers[0].start
        if column + C > self.length:
            raise ValueError(f"compiled KV cache of {self.length} columns overflows ({column} used, {C} fed)")
        key = GraphKey(self.bucket, C, tail, hidden, self.length, self.index, isinstance(masks, SeenColumns))
        graph = self.graphs.get(key) or self._new_graph(key, input_ids, positions, masks)
        graph.write(input_ids, positions, masks)
        self.write_at.fill_(column)
        if self.write_at.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were copied out
        logits, states = self.decoding.call(key, graph)
        for layer in self.cache.layers:
            layer.start += C
        return DecodeOutput(logits[:B].clone(), GraphStates(states, B) if hidden else None)

    def _new_graph(self, key: GraphKey, input_ids, positions, masks) -> _Graph:
        d = self.decoding
        if d.graph_count() >= MAX_GRAPHS:
            raise RecompileError(f"compiled decoding of {d.name} would hold more than {MAX_GRAPHS} graphs "
                                 f"(new: {key}): a step shape that keeps changing; decode it eagerly (CacheMode("
                                 "static=True)) or fix the caller's widths")

        def padded(t: torch.Tensor) -> torch.Tensor:  # dummy rows: token 0 at position 0
            return t.new_zeros(self.bucket, *t.shape[1:])

        def padded_mask(m: torch.Tensor) -> torch.Tensor:
            return _visible(m.new_empty(self.bucket, *m.shape[1:])).contiguous()

        if key.hidden:
            d.prepare_hidden_states()
        seen = isinstance(masks, SeenColumns)
        if seen and d.mask_format is None:
            raise ValueError("SeenColumns for a model whose mask format is not known: CompiledDecoding.mask_format is "
                             "set (MaskFormat.learn) before a step passes them")
        if seen:  # dummy rows see every column up to their query's (their outputs are never read; start() resets)
            bufs_mask = torch.ones(self.bucket, self.length, dtype=torch.bool, device=d.device)
        elif isinstance(masks, dict):
            bufs_mask = {k: padded_mask(m) for k, m in masks.items()}
        else:
            bufs_mask = padded_mask(masks)
        bufs = (padded(input_ids), padded(positions), bufs_mask)
        step = _step_function(self.cache, d.cache_kwarg, key.hidden, self.write_at, d.takes_cache_position,
                              d.mask_format if seen else None)
        fn = torch.compile(own_code(step, f"decode_step_{key}"), backend=d.backend_for(key), fullgraph=True,
                           dynamic=False)
        graph = _Graph(fn, *bufs)
        self.graphs[key] = graph
        return graph


class SlotPool:
    """A model's slots: each a fixed cache of one batch bucket and the graphs compiled on it, all at the run's length
    (the first call's need rounded up to 256, or `fixed`; doubled when a later call needs more). A slot serves one
    decoding at a time and goes back at release(), or when its holder is garbage collected. Subclasses make slots
    (new_slot), which have bucket, length, busy and lease attributes and a start(rows) method."""

    def __init__(self, stats: CompileStats):
        self.stats = stats
        self.length: int | None = None
        self.slots: list = []

    def new_slot(self, bucket: int, length: int, index: int):
        raise NotImplementedError

    def acquire(self, owner: object, rows: int, need: int, fixed: int | None = None, current=None):
        """A free slot for `owner` of rows' bucket, holding at least `need` columns; it is free again when owner is
        garbage collected or acquires another (current: the slot it holds). A call that needs more than the run's
        length doubles it (new caches and graphs: see stats.cache_lengths)."""
        if current is not None:
            self._release(current)
        if self.length is None or need > self.length:
            self.length = max(run_length(need, fixed), 2 * self.length if self.length else 0)
            self.slots = [slot for slot in self.slots if slot.busy]  # stale sizes go once free
            self.stats.cache_lengths.append(self.length)
        bucket = batch_bucket(rows)
        mine = [s for s in self.slots if s.bucket == bucket and s.length == self.length]
        slot = next((s for s in mine if not s.busy), None)
        if slot is None:
            slot = self.new_slot(bucket, self.length, len(mine))
            self.slots.append(slot)
        slot.busy = True
        slot.start(rows)
        slot.lease += 1
        weakref.finalize(owner, self._release, slot, slot.lease)
        return slot

    def release(self, slot) -> None:
        """Free the slot now (its holder's decoding call ended), for the next call to reuse with its warm graphs; the
        finalizer of the lease it ends does nothing then."""
        self._release(slot, slot.lease)

    def _release(self, slot, lease: int | None = None) -> None:
        """Free the slot (lease: only if no later acquire took it since)."""
        if lease is not None and lease != slot.lease:
            return
        slot.busy = False
        slot.lease += 1
        if slot.length != self.length:
            self.slots = [s for s in self.slots if s is not slot]


class CompiledDecoding(SlotPool):
    """One model's compiled decode steps: static caches per batch bucket (slots), graphs per slot and step shape."""

    def __init__(self, model: torch.nn.Module, backend: str, cache_kwarg: str, takes_cache_position: bool):
        self.model = weakref.ref(model)
        self.name = type(model).__name__
        self.backend = backend
        self.device = next(model.parameters()).device
        self.num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self.cache_kwarg, self.takes_cache_position = cache_kwarg, takes_cache_position
        super().__init__(CompileStats(model=self.name, backend=backend))
        self.hidden_ready = False
        self.mask_format: MaskFormat | None = None  # how chain steps' masks are built in the graph (BatchKV learns it)
        self.mask_format_for: str | None = None     # the attention implementation it was learned for (None: not yet;
        #                                             mask_format None then: the model's masks come built)

    def new_slot(self, bucket: int, length: int, index: int) -> _Slot:
        return _Slot(self, bucket, length, index)

    def graph_count(self) -> int:
        return sum(len(slot.graphs) for slot in self.slots)

    @torch.no_grad()
    def prepare_hidden_states(self) -> None:
        """One eager one-token forward with output_hidden_states before the first graph that returns them: some
        transformers releases install their hidden-state capturing hooks at the first such forward, under a lock that
        dynamo cannot trace (a compiled step would fail). Once per model."""
        if not self.hidden_ready:
            self.model()(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), use_cache=False,
                         output_hidden_states=True)
            self.hidden_ready = True

    def backend_for(self, key: GraphKey) -> Callable:
        return counting_backend(self.backend, self.device, self.stats, str(key))

    def call(self, key: GraphKey, graph: _Graph):
        """Run a graph: its first call compiles, later ones must not (call_graph)."""
        out = call_graph(self.stats, str(key), graph.calls == 0, graph.fn, self.model(), graph.input_ids,
                         graph.positions, graph.masks)
        graph.calls += 1
        return out


# model -> its CompiledDecoding (or a draft kind's own compiled steps: attach), which goes with the model (a copy of
# the model gets its own)
_DECODINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach(model: torch.nn.Module, decoding) -> None:
    """Register a draft kind's own compiled steps for `model` (an object with .stats, a CompileStats, and .backend),
    so that compile_stats(model) counts them and release(model) drops them."""
    _DECODINGS[model] = decoding


def compiled_decoding(model: torch.nn.Module, backend: str, cache_kwarg: str,
                      takes_cache_position: bool) -> CompiledDecoding:
    """The model's CompiledDecoding, made anew for another backend."""
    decoding = _DECODINGS.get(model)
    if decoding is None or decoding.backend != backend:
        decoding = _DECODINGS[model] = CompiledDecoding(model, backend, cache_kwarg, takes_cache_position)
    return decoding


def release(model: torch.nn.Module) -> None:
    """Drop the model's compiled graphs and caches now (they go with the model anyway): a stage that is done with a
    model it keeps frees their memory. A BatchKV still decoding keeps its own cache until it is gone."""
    _DECODINGS.pop(model, None)


def decoding_of(model: torch.nn.Module) -> CompiledDecoding | None:
    """The model's CompiledDecoding, None before its first compiled decoding."""
    return _DECODINGS.get(model)


def compile_stats(model: torch.nn.Module) -> CompileStats:
    """The model's compile counters (empty when its decoding never compiled)."""
    decoding = _DECODINGS.get(model)
    return decoding.stats if decoding is not None else CompileStats(model=type(model).__name__)
