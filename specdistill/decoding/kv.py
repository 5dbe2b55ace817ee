"""Batched decoding state: one model's KV cache over ragged rows (with per-row rollback), and ragged token lists.

Layout of BatchKV (B rows, S cache columns). A column holds one token slot for every row; `mask` (B, S) says which
slots are real (the attention mask), and `positions` (B, S) the position id of each slot: a row's positions count its
real tokens. Rows start left-padded (a ragged prefill computes only the real tokens, packed: prefill()); a growing
cache can drop rows between rounds (select_rows(): decoding takes out the rows that stopped).
Each forward appends C columns for all rows (a "tail"); commit(keep) then says, per row, which tail slots survive:
  - columns after the last slot any row keeps are cropped (one crop per layer);
  - a row that kept fewer slots gets its rejected slots masked: holes that attention skips.
Keys and values already carry their rotary position, so a masked hole (or a moved column) leaves every later
forward exactly as if each row had its own dense cache: no recomputation, no re-feeding of accepted tokens.
Holes cost attention work, so when more than a quarter of the columns (and at least 32) are padding for the
widest row, compact() moves each row's real columns right (one gather) and drops the all-padding ones.

Sliding-window layers (Mistral, Gemma-3's local layers) are stored as full columns too, and their window is applied
by the mask, built from `positions`: a query at position p sees the keys at positions > p - window, so the window
counts a row's real tokens, never its holes or padding (transformers' own sliding layers count columns, which holes
would break). The model then gets ready 4D masks, one per layer type where the config lists layer types (as
transformers' generate passes them). Where every layer slides, columns out of every row's window are masked as dead,
so compaction also bounds the cache to about the window; in hybrid models (Gemma-3) the sliding layers alone drop
such columns from their front (their masks start at that column), the full layers keep them. Other layer types
(linear attention, chunked, KV sharing) are refused by name. The columns live in transformers' DynamicLayers, or
StaticLayers (max_length=...); both roll back through their own crop().

CacheMode says which of the two a decoding call uses, and whether its decode forwards run as compiled graphs
(compiled.py: one per batch bucket and step width, compiled once; CUDA graphs on CUDA). Static caches are
compiled.ColumnLayers: an eager forward attends to the used columns only (the growing cache's width and masks, so
a static cache is never slower), a compiled one to every column at fixed shapes and addresses, its masks ready 4D.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, StaticLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, and_masks, causal_mask_function

from specdistill.models.attention import GROUPED_SDPA

from .compiled import MaskFormat, SeenColumns, compiled_decoding, static_cache, width_bucket

# Layer types whose attention BatchKV can mask per row (config layer_types, as transformers' cache_utils names them).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# Why the other types are refused: rollback needs one key/value per token and a mask that depends on positions only.
_REFUSED_BECAUSE = {
    "chunked_attention": "chunked attention is not masked per row here",
    "linear_attention": "a recurrent state cannot drop rejected tokens per row",
    "conv": "a convolution state cannot drop rejected tokens per row",
    "hybrid": "a recurrent state cannot drop rejected tokens per row",
    "hybrid_sliding": "a recurrent state cannot drop rejected tokens per row",
    "dummy": "layers sharing another layer's cache are not supported",
}
# Attention implementations that take the ready 4D masks sliding layers need (flash kernels window by column).
MASKED_ATTENTION = ("sdpa", GROUPED_SDPA, "eager")


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


def layer_types(config) -> list[tuple[str, int | None]]:
    """(layer type, sliding window or chunk size) of each decoder layer, in cache-layer order, read from the config's
    own fields: `layer_types` where the config lists them, else every layer slides when `sliding_window` is set (or
    is chunked when `attention_chunk_size` is). transformers infers them the same way, but the helper that does it
    (cache_utils.get_layer_types_and_kwargs) changed its return type across 5.x, so the rule is written out here.
    Heterogeneous configs (a `per_layer_config` view) give each layer its own window; layers that share another
    layer's cache (`kv_sharing_modes` "reuse", `num_kv_shared_layers`) or hold no attention (moe, mlp) are "dummy"."""
    n = config.num_hidden_layers
    per_layer = getattr(config, "per_layer_config", None)
    per_layer = list(per_layer) if per_layer is not None and len(per_layer) == n else [config] * n
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if getattr(c, "sliding_window", None) is not None
                 else "chunked_attention" if getattr(c, "attention_chunk_size", None) is not None
                 else "full_attention" for c in per_layer]
    types = ["dummy" if t in ("moe", "mlp") else t for t in types]
    sharing = getattr(config, "kv_sharing_modes", None)
    if sharing is not None:
        types = ["dummy" if mode == "reuse" else t for t, mode in zip(types, sharing)]
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    types = types[: len(types) - shared] + ["dummy"] * shared
    windows = [getattr(c, "sliding_window", None) if "sliding" in t
               else getattr(c, "attention_chunk_size", None) if t == "chunked_attention" else None
               for t, c in zip(types, per_layer)]
    return list(zip(types, windows))


def layer_windows(model: torch.nn.Module) -> list[int | None]:
    """Sliding window of each decoder layer, in cache-layer order (None: full attention); attention_windows() checks."""
    windows = attention_windows(model)
    return [windows[layer_type] for layer_type, _ in layer_types(model.config.get_text_config(decoder=True))]


def attention_windows(model: torch.nn.Module) -> dict[str, int | None]:
    """Layer type -> sliding window (None: full attention), for each attention layer type of the model.

    Raises a ValueError naming the type for layers whose cache state is not one key/value per token (linear
    attention, conv, hybrid), whose mask is not a window (chunked), or that share another layer's cache (dummy).
    """
    config = model.config.get_text_config(decoder=True)
    windows: dict[str, int | None] = {}
    for layer_type, window in layer_types(config):
        if layer_type not in SUPPORTED_LAYER_TYPES:
            why = _REFUSED_BECAUSE.get(layer_type, "this layer type is unknown to the rollback")
            raise ValueError(f"{type(model).__name__} has {layer_type!r} layers: {why}; speculative decoding supports "
                             f"targets and drafts whose layers are all {' or '.join(SUPPORTED_LAYER_TYPES)}")
        if windows.setdefault(layer_type, window) != window:
            raise ValueError(f"{type(model).__name__} has {layer_type!r} layers with different windows "
                             f"({windows[layer_type]} and {window}); one window per layer type is supported")
    attn = getattr(config, "_attn_implementation", None)
    if any(w is not None for w in windows.values()) and attn not in MASKED_ATTENTION:
        raise ValueError(f"{type(model).__name__} has sliding-window layers and attn_implementation={attn!r}, which "
                         f"windows by cache column; load it with attn_implementation in {MASKED_ATTENTION}")
    return windows


def rollback(layer, tokens_to_remove: int) -> None:
    """Drop the last `tokens_to_remove` (>= 0) columns of one cache layer: a growing layer slices, a static one moves
    its write position back in place (its address stays; the next update overwrites the stale columns).
    transformers' StaticLayer.crop() does the same from 5.24 on; it is written out here for the releases before."""
    if tokens_to_remove <= 0:
        return
    if isinstance(layer, StaticLayer):
        layer.cumulative_length.sub_(tokens_to_remove)
    else:
        layer.crop(-tokens_to_remove)


@dataclass(frozen=True)
class CacheMode:
    """How one decoding call holds its KV caches (the target's and an LM draft's).

    static: caches preallocated to the call's longest possible length (prompt + max_new_tokens + one round), keys and
    values written in place; eager forwards attend to the used columns only, as growing caches do. compile: the decode
    forwards (not the prefill) run as compiled graphs (compiled.py: one per batch bucket and step width, each compiled
    once, CUDA graphs on CUDA); it implies static. Its caches belong to the model and are reused from call to call at
    one length per run: max_length when given (the run's longest call: prompt + max_new_tokens + gamma + 1), else the
    first call's need rounded up to 256, doubled when a later call needs more. backend: torch.compile's; "inductor"
    serves, "eager" / "aot_eager" trace with dynamo alone (its guards and recompiles are the same: tests use them).
    All of them decode the growing caches' tokens."""

    static: bool = False
    compile: bool = False
    max_length: int | None = None
    backend: str = "inductor"

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"CacheMode max_length must be >= 1 (or None), got {self.max_length}")

    @property
    def is_static(self) -> bool:
        return self.static or self.compile

    def factory(self, max_length: int) -> Callable[[torch.nn.Module], "BatchKV"]:
        """model -> a BatchKV of this mode for a call whose rows hold at most max_length columns."""
        if not self.is_static:
            return BatchKV
        if not self.compile:
            make = functools.partial(BatchKV, max_length=max_length, compile=False)
        else:
            make = functools.partial(BatchKV, max_length=max_length, compile=True, run_length=self.max_length,
                                     backend=self.backend)
        make.mode, make.max_length = self, max_length  # read by drafters that keep caches of their own (of_factory)
        return make

    @staticmethod
    def of_factory(new_kv: Callable) -> tuple["CacheMode", int | None]:
        """(the mode, the call's column count) a factory() result was made for; BatchKV itself: growing, None."""
        return getattr(new_kv, "mode", CacheMode()), getattr(new_kv, "max_length", None)


@dataclass
class CommitPlan:
    """BatchKV.commit_begin()'s result: what commit_end() applies once the sizes are on the host."""

    mask: torch.Tensor     # (B, S) the committed mask, kept tail slots 1
    length: torch.Tensor   # (B,) real tokens per row after the commit
    sizes: torch.Tensor    # (3,) long: last kept tail column, real columns of the widest row, first visible column


def window_by_position(positions: torch.Tensor, window: int) -> Callable:
    """Mask function (transformers' masking_utils protocol, indices are cache columns): key kv is inside query q's
    window when its position is > q's position - window. positions (B, S) covers every column, the tail included."""

    def inside(batch_idx, head_idx, q_idx, kv_idx):
        return positions[batch_idx, kv_idx] > positions[batch_idx, q_idx] - window

    return inside


def same_segment(segment: torch.Tensor) -> Callable:
    """Mask function (masking_utils protocol) of packed rows: key kv is visible to query q when both are slots of the
    same packed prompt; segment (N, T) says whose each column is (-1: padding)."""

    def inside(batch_idx, head_idx, q_idx, kv_idx):
        return segment[batch_idx, kv_idx] == segment[batch_idx, q_idx]

    return inside


def tail_visibility(visible: torch.Tensor, start: int) -> Callable:
    """Mask function (masking_utils protocol) for a tree tail: visible (B, C, T) says which of the T uncommitted tail
    columns (from column `start`) each of the C newest queries sees (itself and its ancestors in a token tree). Keys
    outside the tail are left to the other rules (causal, padding, window)."""
    C, T = visible.shape[1:]
    first_query = start + T - C

    def inside(batch_idx, head_idx, q_idx, kv_idx):
        t = kv_idx - start
        in_tail = (t >= 0) & (t < T)
        seen = visible[batch_idx, (q_idx - first_query).clamp(0, C - 1), t.clamp(0, T - 1)]
        return ~in_tail | seen

    return inside


class BatchKV:
    """A causal LM plus its KV cache for B ragged rows; step() feeds tokens, commit() keeps some per row.

    max_length None: transformers DynamicLayers that grow by concatenation. An int: compiled.ColumnLayers
    preallocated to max_length columns (fixed addresses, as torch.compile and CUDA graphs want); rollback then moves
    their write position, and a step that would overflow compacts first, or raises if the rows' real tokens do not fit.
    compile (static caches only): step() runs compiled graphs (compiled.CompiledDecoding, on the model's cache of the
    batch's bucket, at least run_length columns); prefill() stays eager. backend: see CacheMode.
    """

    def __init__(self, model: torch.nn.Module, max_length: int | None = None, compile: bool = False, *,
                 run_length: int | None = None, backend: str = "inductor"):
        self.model = model
        self.windows = attention_windows(model)
        self.config = model.config.get_text_config(decoder=True)
        if max_length is not None and max_length < 1:
            raise ValueError(f"BatchKV max_length must be >= 1 (or None for a growing cache), got {max_length}")
        if compile and max_length is None:
            raise ValueError("BatchKV(compile=True) needs a static cache: pass max_length (CacheMode.factory does)")
        self.max_length = max_length
        self._need, self._run_length = max_length, run_length  # compile: this call's columns, the run's length
        self.sliding = any(w is not None for w in self.windows.values())
        # Where every layer slides, a column behind every row's window is dead: masking it lets compact() drop it.
        self.dead_behind = max(self.windows.values()) if all(w is not None for w in self.windows.values()) else None
        # Hybrid models: full layers need every column, sliding ones only those inside some row's window. Growing
        # caches drop the others from the front of their sliding layers (front[i] columns of layer i are gone).
        per_layer = layer_windows(model)
        self.front_window = max((w for w in per_layer if w is not None), default=None)
        self._crops_front = [w is not None and self.dead_behind is None and max_length is None for w in per_layer]
        self.front = 0  # columns cropped off the front of every layer in _crops_front
        # Full-attention layers for every layer type (no config): sliding layers keep full columns, the window lives
        # in the mask. transformers' sliding layer classes would keep only the last window-1 columns, which is
        # window-1 positions only while no row has holes or padding.
        self.cache = DynamicCache() if max_length is None else static_cache(self.config.num_hidden_layers, max_length)
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self.compiled = compiled_decoding(model, backend, self._cache_kwarg, "cache_position" in params) \
            if compile else None
        self.slot = None  # compile: the model's cache and graphs this BatchKV holds (from prefill on until close)
        self.closed = False  # close() ended this decoding: no step until the next prefill
        self._keep_last_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.max_positions = max_positions(model)
        self.mask: torch.Tensor | None = None       # (B, S) long, 1 = real token slot
        self.positions: torch.Tensor | None = None  # (B, S) long, position id of each slot (padding: any)
        self.length: torch.Tensor | None = None     # (B,) real tokens per row, tail included = next position id
        self.committed = 0                          # columns before the uncommitted tail
        self._tail_real = True                      # every uncommitted tail slot is a real token (commit's fast path)
        self._constants: dict[tuple, torch.Tensor] = {}
        self._committed_length: torch.Tensor | None = None  # (B,) real tokens per row before the tail

    def close(self) -> None:
        """End this decoding: a compiled cache's slot goes back to the model's CompiledDecoding now, so the next call
        of the same bucket reuses it and its warm graphs (not when this object happens to be garbage collected). The
        decoding calls close their caches as they return; a closed BatchKV steps again only after a new prefill.
        Growing and plain static caches are this object's own: close() only marks it closed."""
        if self.slot is not None:
            self.compiled.release(self.slot)
            self.slot = None
        self.closed = True

    def __enter__(self) -> "BatchKV":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
        """Feed a left-padded (B, T) batch (T may be 0) and commit its real tokens; returns the model output or None.
        Its hidden_states (output_hidden_states=True) are per row as the batch is laid out; its logits are not for
        reading (decoding starts from the pending token): a packed prefill returns none.

        Ragged rows are packed (pack_rows): several short prompts share one row of the forward, each attending to
        itself only, so the forward computes the real tokens and not the left padding; the keys, values and hidden
        states then go back to each row's left-padded columns."""
        B = input_ids.shape[0]
        device = device_of(self.model)
        self.mask = torch.zeros(B, 0, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, 0, dtype=torch.long, device=device)
        self.length = torch.zeros(B, dtype=torch.long, device=device)
        self._committed_length = self.length
        self.committed = 0
        self._tail_real = True
        if self.compiled is not None:  # the model's cache of this batch's bucket, which earlier calls' graphs know
            self.slot = self.compiled.acquire(self, B, self._need, self._run_length, current=self.slot)
            self.cache, self.max_length = self.slot.cache, self.slot.length
        self.closed = False
        if input_ids.shape[1] == 0:
            return None
        packing = None
        if set(kwargs) <= {"output_hidden_states"} and self.config._attn_implementation in MASKED_ATTENTION:
            packing = pack_rows(attention_mask.sum(1).tolist(), input_ids.shape[1])
        if packing is None:
            out = self.step(input_ids, attention_mask.bool(), eager=True, **self._keep_last_logits, **kwargs)
        else:
            out = self._packed_prefill(input_ids, attention_mask, packing, **kwargs)
        self.commit_all()  # left padding stays as masked columns
        return out

    def _packed_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, packing: "Packing", **kwargs):
        """prefill() of a ragged batch as packed rows: one forward over (N, T) packed rows (N < B) into a scratch
        cache, then every layer's keys and values gathered into the batch's left-padded layout (B, H, T, D) and
        written to this cache as one update."""
        device = device_of(self.model)
        B, T = input_ids.shape
        valid = attention_mask.to(device).bool()                                       # (B, T)
        if self.max_length is not None:
            self._make_room(T)
        src_row, src_col = packing.source.to(device).unbind(0)                          # (N, T) each
        ids = input_ids.to(device)[src_row, src_col]                                    # (N, T) packed tokens
        segment = packing.segment.to(device)                                            # (N, T) row of each slot
        real = segment >= 0
        positions = (src_col - (T - valid.sum(1))[src_row]).clamp(min=0)               # (N, T) from 0 per row
        masks = self._masks(ids.shape[0], T, T, 0, real, positions, and_masks(causal_mask_function,
                                                                              same_segment(segment)))
        scratch = DynamicCache() if self.max_length is None else static_cache(self.config.num_hidden_layers, T)
        out = self.model(input_ids=ids, attention_mask=masks, position_ids=positions, use_cache=True,
                         **{self._cache_kwarg: scratch}, **self._keep_last_logits, **kwargs)
        setattr(out, self._cache_kwarg, self.cache)  # the output's cache field has the forward's kwarg's name
        at_bin, at_col = packing.target.to(device).unbind(0)                            # (B, T) each
        for i, layer in enumerate(scratch.layers):
            k, v = layer.keys[:, :, :T], layer.values[:, :, :T]                          # (N, H, T, D)
            keys = k.transpose(1, 2)[at_bin, at_col].transpose(1, 2)                    # (B, H, T, D)
            values = v.transpose(1, 2)[at_bin, at_col].transpose(1, 2)
            layer.keys = layer.values = k = v = None  # each scratch layer goes as it is moved: the peak stays ~1x
            self.cache.update(keys.contiguous(), values.contiguous(), i)
        if getattr(out, "hidden_states", None) is not None:
            out.hidden_states = tuple(h[at_bin, at_col] * valid[..., None] for h in out.hidden_states)  # (B, T, H)
        out.logits = None
        self.mask = valid.long()
        self.positions = (valid.long().cumsum(1) - 1).clamp(0, None if self.max_positions is None
                                                            else self.max_positions - 1)
        self.length = valid.sum(1)
        return out

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, *, positions: torch.Tensor | None = None,
             tail_visible: torch.Tensor | None = None, eager: bool = False, **kwargs):
        """Append (B, C) tokens; valid (B, C) bool marks the real ones (others are masked padding slots).
        eager: run the model uncompiled even when the cache compiles (the prefill: a new shape per prompt batch).
        Compiled steps take no kwargs but output_hidden_states.

        Token trees (decoding/tree.py): positions (B, C) are the new tokens' position ids (by depth) and tail_visible
        (B, C, T) which of the T uncommitted tail columns, these C included, each new token sees (its ancestors and
        itself) instead of every earlier one; commit_path() (or gather_tail() and commit_begin()) then keeps one path
        per row. Compiled tree steps run at their width's bucket (compiled.width_bucket), padded with slots that are
        dropped again after the forward."""
        if self.closed:
            raise ValueError("BatchKV.step after close(): the decoding call that held this cache ended (its compiled "
                             "cache may serve another call now); prefill() again to start a new decoding")
        device = device_of(self.model)
        input_ids = input_ids if input_ids.device == device else input_ids.to(device)
        B, C = input_ids.shape
        every = valid is None  # every slot real: positions, mask and lengths from host constants (fewer kernels)
        if self.slot is not None and not eager and tail_visible is not None and self.slot.ready:
            pad = width_bucket(C) - C
            if pad:
                valid = torch.ones_like(input_ids, dtype=torch.bool) if every else valid.to(device)
                return self._padded_step(input_ids, valid, positions, tail_visible.to(device), pad, **kwargs)
        if self.max_length is not None:
            self._make_room(input_ids.shape[1])
        tail = self.mask.shape[1] + input_ids.shape[1] - self.committed     # uncommitted columns once these are fed
        if tail_visible is not None and tail_visible.shape[-1] != tail:
            raise ValueError(f"tail_visible {tuple(tail_visible.shape)} must cover the {tail} uncommitted tail columns")
        if every:
            real = self._constant("ones", B, C, device)                    # (B, C) long
        else:
            valid = valid if valid.device == device else valid.to(device)
            real = valid.long()
        if positions is None:  # (B, C); padding repeats a position
            positions = self.length[:, None] + (self._constant("arange", 1, C, device) if every else real.cumsum(1) - 1)
        # Clamping only touches tokens past the row's budget: their outputs are never used, and they are not kept.
        positions = positions.clamp(0, None if self.max_positions is None else self.max_positions - 1)
        self.mask = torch.cat([self.mask, real], dim=1)                     # (B, S + C)
        self.positions = torch.cat([self.positions, positions], dim=1)     # (B, S + C)
        self._tail_real = self._tail_real and every
        if self.slot is not None and not eager and self.slot.ready:
            hidden = bool(kwargs.pop("output_hidden_states", False))
            if kwargs:
                raise ValueError(f"compiled decode steps take a fixed kwarg set (output_hidden_states only), got "
                                 f"{sorted(kwargs)}: pass eager=True for such a step")
            tail = None if tail_visible is None else tail_visible.shape[-1]
            out = self.slot.run(input_ids, positions, self._compiled_masks(C, tail_visible), hidden, tail)
        else:
            out = self.model(input_ids=input_ids, attention_mask=self._attention_mask(C, tail_visible),
                             position_ids=positions, use_cache=True, **{self._cache_kwarg: self.cache}, **kwargs)
        self.length = self.length + (C if every else real.sum(1))
        return out

    def _constant(self, kind: str, B: int, C: int, device) -> torch.Tensor:
        """Host-shaped constants a step reuses rather than building: "ones" (B, C) long, "arange" (1, C) long 0..C-1.
        Never written to (every use makes a new tensor of it)."""
        key = (kind, B, C, device)
        if key not in self._constants:
            self._constants[key] = (torch.ones(B, C, dtype=torch.long, device=device) if kind == "ones"
                                    else torch.arange(C, device=device)[None])
        return self._constants[key]

    def _padded_step(self, input_ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor | None,
                     tail_visible: torch.Tensor, pad: int, **kwargs):
        """A compiled tree step widened by `pad` padding slots (masked: no query sees them, their own queries see the
        committed columns), which are dropped again right after the forward: the tail, the cache and the outputs are
        those of the C tokens fed. Trees of any size then share a few graphs (widths 1, 2, 4, ...)."""
        if positions is None:
            positions = self.length[:, None] + valid.long().cumsum(1) - 1  # (B, C)
        F = torch.nn.functional
        out = self.step(F.pad(input_ids, (0, pad)), F.pad(valid, (0, pad), value=False),
                        positions=torch.cat([positions, positions[:, -1:].expand(-1, pad)], dim=1),
                        tail_visible=F.pad(tail_visible, (0, pad, 0, pad), value=False), **kwargs)  # (B, C+p, T+p)
        self.mask, self.positions = self.mask[:, :-pad], self.positions[:, :-pad]
        for layer in self._filled_layers():
            rollback(layer, pad)
        out.logits = out.logits[:, :-pad]
        if out.hidden_states is not None:
            out.hidden_states = tuple(h[:, :-pad] for h in out.hidden_states)
        return out

    def reserve(self, columns: int) -> None:
        """Static caches: make room for `columns` more before the next commit. A drafter that feeds several steps
        per round calls it first, since only a committed cache can compact. A growing cache always has room."""
        if self.max_length is not None:
            self._make_room(columns)

    def _make_room(self, C: int) -> None:
        """Static caches: compact when C more columns would overflow; raise if the real tokens alone do not fit."""
        S = self.mask.shape[1]
        if S + C <= self.max_length:
            return
        if S > self.committed:
            raise ValueError(f"static KV cache of {self.max_length} columns is full ({S} used, {C} more fed before a "
                             "commit): build BatchKV with a larger max_length")
        self.compact()
        if self.mask.shape[1] + C > self.max_length:
            raise ValueError(f"static KV cache of {self.max_length} columns cannot hold {self.mask.shape[1]} real "
                             f"tokens plus {C} new ones: build BatchKV with a larger max_length (or None)")

    def _compiled_masks(self, C: int, tail_visible: torch.Tensor | None):
        """A compiled step's masks: the columns each row sees (SeenColumns), which the graph makes into the 4D mask,
        for a chain step of a full-attention model whose mask format compiled.column_mask reproduces (learned once per
        model and attention implementation from one mask built here); else ready 4D masks over every column."""
        if tail_visible is None and not self.sliding:
            compiled, implementation = self.compiled, self.config._attn_implementation
            if compiled.mask_format_for != implementation:  # learned per attention implementation
                compiled.mask_format = MaskFormat.learn(self._attention_mask(C, None, width=self.max_length),
                                                        self.mask, C)
                compiled.mask_format_for = implementation
            if compiled.mask_format is not None:
                return SeenColumns(self.mask)
        return self._attention_mask(C, tail_visible, width=self.max_length)

    def _attention_mask(self, C: int, tail_visible: torch.Tensor | None = None, width: int | None = None):
        """The 2D padding mask (B, S + C) for full-attention models; else ready 4D masks (B, 1, C, S + C), one per
        layer type where the config lists layer types (the model picks each layer's), in its attention
        implementation's format. tail_visible (B, C, T): a token tree in the tail (see step()), always a 4D mask.
        width: 4D masks over that many columns whatever the model (compiled steps: every column of the cache; the
        ones past S + C are masked). Eager forwards on either cache attend to the S + C used columns.

        Built as transformers' create_causal_mask builds them (its mask interface, causal AND padding AND window),
        but called directly: create_causal_mask vmaps any extra mask function, ~10x slower on CPU, while ours is
        index-based and takes the interface's broadcasting path."""
        if not self.sliding and tail_visible is None and width is None:
            return self.mask                                                # (B, S + C)
        B, S = self.mask.shape
        kv_length = S if width is None else width
        padding = torch.nn.functional.pad(self.mask.bool(), (0, kv_length - S))                  # (B, kv_length)
        positions = torch.nn.functional.pad(self.positions, (0, kv_length - S))                  # (B, kv_length)
        rule = causal_mask_function if tail_visible is None else and_masks(
            causal_mask_function, tail_visibility(tail_visible, self.committed))
        return self._masks(B, C, kv_length, S - C, padding, positions, rule)

    def _masks(self, B: int, C: int, kv_length: int, q_offset: int, padding: torch.Tensor, positions: torch.Tensor,
               rule: Callable):
        """Ready 4D masks (B, 1, C, kv_length) of `rule` AND padding (B, kv_length) AND, in sliding layers, the window
        by positions (B, kv_length): one per layer type where the config lists layer types, else the one mask."""
        build = ALL_MASK_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        masks = {}
        for layer_type, window in self.windows.items():
            layer_rule = rule if window is None else and_masks(rule, window_by_position(positions, window))
            front = self.front if window is not None else 0                 # sliding layers may start later
            masks[layer_type] = build(batch_size=B, q_length=C, kv_length=kv_length - front, q_offset=q_offset,
                                      kv_offset=front,
                                      mask_function=layer_rule, attention_mask=padding, allow_is_causal_skip=False,
                                      dtype=self.model.dtype, config=self.config, use_vmap=False,
                                      device=padding.device)
        return masks if hasattr(self.config, "layer_types") else next(iter(masks.values()))

    def commit_all(self) -> None:
        """Keep the whole tail as fed (no host sync)."""
        self.committed = self.mask.shape[1]
        self._committed_length = self.length
        self._tail_real = True

    @torch.no_grad()
    def commit(self, keep: torch.Tensor | None = None) -> None:
        """Keep, per row, the tail slots where keep (B, C) is True (default: all real ones); mask the rest.

        Per row, the kept slots must be a prefix of the row's real tail slots: a token's keys and values
        depend on every real token before it, so only a suffix can be dropped (a rejected draft and after).
        One host sync (the crop sizes); a decoding loop that syncs anyway calls commit_begin / commit_end instead.
        """
        plan = self.commit_begin(keep)
        self.commit_end(plan, plan.sizes.tolist())

    @torch.no_grad()
    def commit_begin(self, keep: torch.Tensor | None = None) -> "CommitPlan":
        """commit()'s device work, no host sync: the new mask and lengths, and the crop sizes as a device tensor
        (CommitPlan.sizes) that the caller brings to the host with whatever else it syncs, then commit_end()."""
        S0, S = self.committed, self.mask.shape[1]
        if self._tail_real and keep is not None and S > S0:
            # Every tail slot is real, so a row's kept slots are a prefix of the tail's columns: the last kept column
            # is the longest row's count (the same sizes as below, in fewer kernels).
            keep = keep if keep.device == self.mask.device else keep.to(self.mask.device)
            count = keep.sum(1)                                             # (B,)
            last = count.max()
        else:
            real = self.mask[:, S0:].bool()                                 # (B, C)
            keep = real if keep is None else keep.to(real.device) & real
            kept_cols = torch.where(keep.any(0), torch.arange(S - S0, device=keep.device) + 1, 0)
            last = kept_cols.max() if S > S0 else kept_cols.new_zeros(())  # tail columns any row keeps
            count = keep.sum(1)
        length = self._committed_length + count                             # (B,)
        mask = torch.cat([self.mask[:, :S0], keep.long()], dim=1)           # (B, S)
        if self.dead_behind is not None:  # no later query (position >= length) can see these keys
            mask = mask * (self.positions > (length - self.dead_behind)[:, None])
        widest = mask.sum(1).max()                                          # real columns of the widest row
        sizes = torch.stack([last, widest, self._first_visible(mask, length)])  # (3,)
        return CommitPlan(mask, length, sizes)

    @torch.no_grad()
    def commit_end(self, plan: "CommitPlan", sizes: list[int]) -> None:
        """Apply a commit_begin() plan; sizes: plan.sizes on the host (last kept tail column, widest row, first
        visible column)."""
        last, widest, first = sizes
        S0, S = self.committed, self.mask.shape[1]
        first = min(first, S0 + last)
        for layer in self._filled_layers():
            rollback(layer, S - S0 - last)
        self.length = plan.length
        self.mask, self.positions = plan.mask[:, : S0 + last], self.positions[:, : S0 + last]
        self.committed = S0 + last
        self._committed_length = self.length
        self._tail_real = True
        if self.committed - widest > max(32, self.committed // 4):
            self.compact(widest)
        elif any(self._crops_front) and first - self.front > max(32, self.committed // 4):
            self._crop_front(first)

    @torch.no_grad()
    def commit_path(self, columns: torch.Tensor, count: torch.Tensor) -> None:
        """Keep, per row, the tail slots at tail columns columns[b, :count[b]] (columns (B, W), count (B,)), in that
        order, and drop the rest of the tail: gather_tail(), then commit() (one host sync)."""
        tail = self.mask.shape[1] - self.committed
        self.gather_tail(columns)
        self.commit(torch.arange(tail, device=self.mask.device) < count.to(self.mask.device)[:, None])

    @torch.no_grad()
    def gather_tail(self, columns: torch.Tensor) -> None:
        """Move, per row, the tail slots at tail columns columns[b] (columns (B, W)) to the front of the tail, in that
        order: a token tree's accepted path, each node after its ancestors. A commit() (or commit_begin()) of the
        path's length then keeps it as it keeps accepted chain drafts and drops the rest of the tail.

        The gather touches W columns per layer, never the whole cache; the keys keep the rotary positions they were
        computed at (by depth)."""
        S0 = self.committed
        tail = self.mask.shape[1] - S0
        columns = columns[:, :tail].clamp(0, tail - 1)  # a row keeps at most the tail; entries past count are unused
        W = columns.shape[1]
        at = S0 + columns.to(self.mask.device)                              # (B, W) absolute columns
        B = at.shape[0]  # a compiled cache has its bucket's rows, the first B real
        for i, layer in enumerate(self.cache.layers):
            if not layer.is_initialized:
                continue
            front = self.front if self._crops_front[i] else 0
            idx = (at - front)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            keys, values = layer.keys[:B], layer.values[:B]
            keys[:, :, S0 - front: S0 - front + W] = keys.gather(2, idx)    # (B, H, W, D)
            values[:, :, S0 - front: S0 - front + W] = values.gather(2, idx)
        self.mask[:, S0: S0 + W] = self.mask.gather(1, at)
        self.positions[:, S0: S0 + W] = self.positions.gather(1, at)

    def _first_visible(self, mask: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """() the first column that a sliding layer's window may still show to some row's next queries."""
        if self.front_window is None:
            return mask.new_zeros(())
        visible = mask.bool() & (self.positions > (length - self.front_window)[:, None])      # (B, S)
        first = torch.where(visible.any(1), visible.int().argmax(1), mask.shape[1])            # (B,)
        return first.min()

    def _crop_front(self, first: int) -> None:
        """Drop columns [front, first) from the sliding layers of a hybrid model: no row's window reaches them.
        transformers' crop() only cuts the end, so the slice is ours; the masks start at kv_offset=front."""
        for i, layer in enumerate(self.cache.layers):
            if self._crops_front[i] and layer.is_initialized:
                cut = first - self.front
                layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
        self.front = first

    @torch.no_grad()
    def compact(self, widest: int | None = None) -> None:
        """Right-align every row's real columns (order kept) and drop the columns that are padding for all rows."""
        real = self.mask.bool()                                             # (B, S), no uncommitted tail here
        widest = int(real.sum(1).max()) if widest is None else widest
        order = torch.sort(real.int(), dim=1, stable=True).indices[:, real.shape[1] - widest:]  # (B, widest)
        B, S = real.shape  # a compiled cache has its bucket's rows, the first B real
        for i, layer in enumerate(self.cache.layers):
            if not layer.is_initialized:
                continue
            # A front-cropped sliding layer lacks columns [0, front): they are out of every window, so any key
            # there is masked; the clamp fills them with its first column.
            front = self.front if self._crops_front[i] else 0
            at = (order - front).clamp(min=0)[:, None, :, None]                # (B, 1, widest, 1)
            at = at.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            keys = layer.keys[:B, :, : S - front].gather(2, at)            # (B, H, widest, D)
            values = layer.values[:B, :, : S - front].gather(2, at)
            if front:  # a growing layer: replace its tensors
                layer.keys, layer.values = keys, values
                continue
            rollback(layer, S - widest)
            layer.keys[:B, :, :widest].copy_(keys)                          # in place: static addresses stay
            layer.values[:B, :, :widest].copy_(values)
        self.front = 0
        self.mask = real.gather(1, order).long()
        self.positions = self.positions.gather(1, order)
        self.committed = widest

    @property
    def selects_rows(self) -> bool:
        """select_rows() is possible: growing caches only (a static cache's rows are its allocation, a compiled one's
        its graphs' batch bucket)."""
        return self.max_length is None

    @torch.no_grad()
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the rows `rows` (R,) long, in that order, between rounds (nothing uncommitted): later steps feed R
        rows. Decoding drops the rows that stopped so that no forward computes for them."""
        if not self.selects_rows:
            raise ValueError("BatchKV.select_rows needs a growing cache (max_length None): a static cache keeps its "
                             "rows")
        if self.mask.shape[1] != self.committed:
            raise ValueError("BatchKV.select_rows with an uncommitted tail: commit first")
        rows = rows.to(self.mask.device)
        for layer in self._filled_layers():
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
        self.mask, self.positions = self.mask.index_select(0, rows), self.positions.index_select(0, rows)
        self.length = self.length.index_select(0, rows)
        self._committed_length = self.length

    def _filled_layers(self):
        return [layer for layer in self.cache.layers if layer.is_initialized]


@dataclass
class Packing:
    """Where a ragged left-padded (B, T) batch's rows sit when packed into N < B rows of width T."""

    source: torch.Tensor   # (2, N, T) long: the batch's (row, column) each packed slot holds (padding: any real slot)
    segment: torch.Tensor  # (N, T) long: the batch row of each packed slot, -1 for padding
    target: torch.Tensor   # (2, B, T) long: the packed (row, column) each batch slot comes from (padding: any)


def pack_rows(lengths: list[int], width: int) -> Packing | None:
    """First-fit decreasing: rows of these real lengths into as few packed rows of `width` slots as it finds, each
    packed row's padding first (on the left, as the batch pads), then its prompts in batch order. None when packing
    saves no row (every row needed) or there is nothing to pack."""
    order = sorted((b for b, n in enumerate(lengths) if n > 0), key=lambda b: -lengths[b])
    bins: list[list[int]] = []
    room: list[int] = []
    for b in order:
        i = next((i for i, r in enumerate(room) if r >= lengths[b]), len(bins))
        if i == len(bins):  # no packed row has room: open one
            bins.append([])
            room.append(width)
        bins[i].append(b)
        room[i] -= lengths[b]
    if not bins or len(bins) >= len(lengths):
        return None
    N, B = len(bins), len(lengths)
    source = torch.zeros(2, N, width, dtype=torch.long)
    segment = torch.full((N, width), -1, dtype=torch.long)
    target = torch.zeros(2, B, width, dtype=torch.long)
    first = bins[0][0]
    source[0], source[1] = first, width - 1  # padding slots read a real slot (masked, never kept)
    for i, rows in enumerate(bins):
        col = room[i]
        for b in sorted(rows):
            n = lengths[b]
            source[0, i, col: col + n], source[1, i, col: col + n] = b, torch.arange(width - n, width)
            segment[i, col: col + n] = b
            target[0, b], target[1, b, width - n:] = i, torch.arange(col, col + n)
            target[1, b, : width - n] = col  # the row's padding reads its first slot (masked, zeroed)
            col += n
    for b in range(B):
        if lengths[b] == 0:
            target[0, b], target[1, b] = 0, width - 1
    return Packing(source, segment, target)


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

    def select_rows(self, rows: torch.Tensor) -> "TokenBuffer":
        """A buffer of the rows `rows` (R,), in that order."""
        out = TokenBuffer.__new__(TokenBuffer)
        out.fill, out._data, out.length, out._upper = self.fill, self._data[rows], self.length[rows], self._upper
        return out

    def append_one(self, token: torch.Tensor, where: torch.Tensor) -> None:
        """Append token[b] (B,) to the rows b where `where` (B,) bool holds: append(token[:, None], where) in fewer
        kernels (one token per row: a target-only decode step)."""
        capacity = self._data.shape[1] - 1
        if self._upper + 1 > capacity:
            self.append(token[:, None], where.long())
            return
        idx = torch.where(where, self.length, capacity)                     # (B,) unwritten -> trash column
        self._data.scatter_(1, idx[:, None], token[:, None])
        self.length = self.length + where
        self._upper += 1

    def append(self, new: torch.Tensor, count: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Append the first count[b] tokens of new[b] (B, C) to row b; rows (R,): new and count (R, ...) are those
        rows' (the others append nothing)."""
        if rows is not None:
            new, count = on_rows(new, rows, self.length.shape[0], self.fill), on_rows(count, rows, self.length.shape[0])
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


def on_rows(x: torch.Tensor, rows: torch.Tensor | None, batch: int, fill=0) -> torch.Tensor:
    """x (R, ...), the values of rows `rows` (R,) of a batch -> (batch, ...) with `fill` in the other rows; rows None:
    x is every row's already."""
    if rows is None:
        return x
    out = x.new_full((batch, *x.shape[1:]), fill)
    return out.index_copy_(0, rows.to(x.device), x)
