"""EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840) in exactly the serving engines' "midlayer" layout.

Parameter names are the checkpoint names vLLM and SGLang load:
  fc [H, 3*Ht] | midlayer.{input_layernorm, hidden_norm, post_attention_layernorm} [H]
  midlayer.self_attn.{q,k,v}_proj [*, 2H], o_proj [H, nh*hd] | midlayer.mlp.{gate,up,down}_proj | norm [H]
  lm_head [Vd, H] | d2t int64 [Vd] (target_id = draft_id + d2t[draft_id]) | t2d bool [V] | embed_tokens [V, H] (frozen)
The layer: q/k/v read concat(input_layernorm(embed(token)), hidden_norm(g)) (2H); the residual stream is g itself
(norm_before_residual = false); then post-attention norm + MLP; logits = lm_head(norm(out)) over the draft vocabulary.
embed(token) is exactly the target's input embedding: its weight rows times `embed_scale` (Gemma's sqrt(hidden), 1.0
for most models; measured from the target's embedding module). The head's logits are never soft-capped: serving
engines apply no cap to a draft head (vLLM's Eagle3LlamaForCausalLM), and greedy drafting does not depend on it.

Position convention (documented choice): the head's slot t pairs the fused target feature g_t with token t+1 and
predicts token t+2; its RoPE position id is t, and unrolled step j uses t + j (EAGLE / SpecForge / vLLM's proposer,
where each draft step advances the position by one).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from specdistill.flops import checkpoint_contexts
from specdistill.models.layers import GatedMLP, RMSNorm, apply_rope, rope_cos_sin
from specdistill.models.layers import rope_inv_freq as layers_rope_inv_freq
from specdistill.models.vocab import DraftVocabMaps


@dataclass
class Eagle3Config:
    hidden_size: int  # H
    intermediate_size: int  # I
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # the target's (a 2048 default cut acceptance in serving)
    vocab_size: int  # V, the target's
    draft_vocab_size: int  # Vd
    target_hidden_size: int  # Ht
    aux_layer_ids: list[int] = field(default_factory=list)  # vLLM convention: k = output_hidden_states[k]
    hidden_act: str = "silu"
    rope_scaling: Optional[dict] = None
    embed_scale: float = 1.0  # the target's embedding module multiplies weight rows by this (Gemma: sqrt(hidden))

    @classmethod
    def from_target(cls, tcfg, draft_vocab_size: int, aux_layer_ids: list[int],
                    embed_scale: float = 1.0) -> "Eagle3Config":
        rope = target_rope_parameters(tcfg)
        theta = rope.get("rope_theta", getattr(tcfg, "rope_theta", 10000.0))
        scaling = ({k: v for k, v in rope.items() if k != "rope_theta"}
                   if rope.get("rope_type", "default") != "default" else None)
        return cls(hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
                   num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
                   head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads,
                   rms_norm_eps=tcfg.rms_norm_eps, rope_theta=float(theta),
                   max_position_embeddings=tcfg.max_position_embeddings, vocab_size=tcfg.vocab_size,
                   draft_vocab_size=min(draft_vocab_size, tcfg.vocab_size), target_hidden_size=tcfg.hidden_size,
                   # silu whatever the target uses (Gemma: gelu): the head is the engines' Llama layer, whose
                   # MLP is silu only (vLLM's LlamaMLP refuses other activations)
                   aux_layer_ids=list(aux_layer_ids), hidden_act="silu", rope_scaling=scaling,
                   embed_scale=float(embed_scale))

    def to_hf_dict(self) -> dict:
        """config.json in the flat-Llama "midlayer" format vLLM and SGLang load."""
        d = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
             "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
             "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
             "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
             "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
             "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
             "hidden_act": self.hidden_act, "tie_word_embeddings": False, "norm_before_residual": False,
             "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)},
             "torch_dtype": "float32"}
        if self.rope_scaling:
            d["rope_scaling"] = self.rope_scaling
        if self.embed_scale != 1.0:  # specdistill's own field (engines ignore it; export.py folds it into the weights)
            d["embed_scale"] = self.embed_scale
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "Eagle3Config":
        aux = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids") or []
        if d.get("aux_layer_convention") == "sglang":  # written by export.py for SGLang: ids shifted by -1
            aux = [k + 1 for k in aux]
        return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
                   head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                   rms_norm_eps=d["rms_norm_eps"], rope_theta=d.get("rope_theta", 10000.0),
                   max_position_embeddings=d["max_position_embeddings"], vocab_size=d["vocab_size"],
                   draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                   target_hidden_size=d.get("target_hidden_size") or d["hidden_size"], aux_layer_ids=list(aux),
                   hidden_act=d.get("hidden_act", "silu"), rope_scaling=d.get("rope_scaling"),
                   embed_scale=float(d.get("embed_scale", 1.0)))


def target_rope_parameters(tcfg) -> dict:
    """The target's RoPE parameters (rope_type, rope_theta, scaling fields). Models with one RoPE per attention type
    (Gemma-3: {"sliding_attention": ..., "full_attention": ...}) give their full-attention one: the head attends over
    the whole context, as the target's global layers do."""
    return single_rope(dict(getattr(tcfg, "rope_parameters", None) or {}))


def single_rope(rope: dict) -> dict:
    """A config's rope_parameters dict, reduced to one RoPE (see target_rope_parameters)."""
    if rope and all(isinstance(v, dict) for v in rope.values()):
        if "full_attention" not in rope:
            raise ValueError(f"the target's per-layer-type rope_parameters {sorted(rope)} have no 'full_attention' "
                             "entry: the EAGLE-3 head needs one RoPE; set target.rope_parameters explicitly")
        rope = dict(rope["full_attention"])
    return rope


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Low / middle / high layers for any depth. For L >= 8 this equals the engines' default (2, L//2, L-3); for
    small targets (where that default breaks) it spreads (1, L//2, L-1), all below L. Ids follow vLLM:
    k = hidden_states[k]."""
    L = num_layers
    if L >= 8:
        return [2, L // 2, L - 3]
    return [min(1, L - 1), min(L // 2, L - 1), L - 1]


def rope_inv_freq(c: "Eagle3Config") -> tuple[torch.Tensor, float]:
    """The head's RoPE: the target's (models/layers.rope_inv_freq)."""
    return layers_rope_inv_freq(c, "EAGLE-3 head")


class Eagle3Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        """x (B, T, 2H) -> q (B, nh, T, hd), k/v (B, nh, T, hd) (kv heads repeated for GQA), RoPE applied."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.nh // self.nkv
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)


@dataclass
class Eagle3StepOutput:
    hidden: torch.Tensor  # (B, n, H) pre-norm output: the next step's input feature
    logits: torch.Tensor  # (B, n, Vd) over the draft vocabulary ((B, 1, Vd) with step(readout_slot=...))
    keys: torch.Tensor  # (B, nh, S + n, hd) the cache after this step (with a SlotCache: views of its buffers,
    # valid until its next append)
    values: torch.Tensor


class SlotCache:
    """The head's key/value cache for decoding, written in place: (R, nh, capacity, hd) buffers whose first `rows`
    rows and first `length` columns are in use. Appending n slots copies those n only (a torch.cat per step copies the
    whole cache, which along a 1024-token output is most of drafting's memory traffic), and a full buffer doubles, so
    N slots cost O(N) copies in all. Cropping sets `length`; what lies past it is overwritten by the next append.

    fixed: the buffers never move (compiled draft steps replay on them, drafts/eagle3/compiled.py): R may exceed rows
    (a batch bucket's dummy rows), a full buffer raises instead of growing, and rows cannot be dropped."""

    def __init__(self, batch: int, heads: int, head_dim: int, device, dtype, capacity: int = 256,
                 fixed: bool = False):
        self.keys = torch.zeros(batch, heads, capacity, head_dim, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.length = 0
        self.rows = batch
        self.fixed = fixed

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reset(self, rows: int) -> None:
        """Empty, for a new decoding of `rows` rows (<= the buffers' rows)."""
        if rows > self.keys.shape[0]:
            raise ValueError(f"SlotCache of {self.keys.shape[0]} rows cannot hold {rows}")
        self.rows, self.length = rows, 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, nh, n, hd) -> the cache's keys and values after them, (B, nh, length + n, hd) views."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            self._grow(end)
        self.keys[: self.rows, :, self.length:end] = k
        self.values[: self.rows, :, self.length:end] = v
        self.length = end
        return self.view()

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[: self.rows, :, : self.length], self.values[: self.rows, :, : self.length]

    def crop(self, length: int) -> None:
        self.length = min(length, self.length)

    def select(self, columns: torch.Tensor) -> None:
        """Keep, per row, the columns `columns` (B, W) in that order: the cache becomes W columns long."""
        idx = columns[:, None, :, None].expand(-1, self.keys.shape[1], -1, self.keys.shape[-1])
        keys, values = self.view()
        keys, values = keys.gather(2, idx), values.gather(2, idx)           # (B, nh, W, hd) copies, then written back
        W = columns.shape[1]
        self.keys[: self.rows, :, :W], self.values[: self.rows, :, :W] = keys, values
        self.length = W

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the rows `rows` (R,), in that order (the buffers become R rows, capacity kept)."""
        if self.fixed:
            raise ValueError("SlotCache(fixed=True) keeps its rows: compiled draft steps replay on its buffers")
        self.keys, self.values = self.keys.index_select(0, rows), self.values.index_select(0, rows)
        self.rows = rows.shape[0]

    def _grow(self, need: int) -> None:
        if self.fixed:
            raise ValueError(f"the head's fixed cache of {self.capacity} columns overflows ({need} needed): its "
                             "compiled draft steps cannot grow it")
        capacity = max(need, 2 * self.capacity)
        keys = self.keys.new_zeros(*self.keys.shape[:2], capacity, self.keys.shape[-1])
        values = torch.zeros_like(keys)
        keys[:, :, : self.length], values[:, :, : self.length] = self.keys[:, :, : self.length], \
            self.values[:, :, : self.length]
        self.keys, self.values = keys, values


@dataclass
class ChainQuery:
    """A sparse TTT unroll read out at chosen states: what `Eagle3Head.forward(..., chains=...)` computes
    (unroll_chains, then the readout), so a DDP / DeepSpeed wrapper's forward carries it and syncs its gradients."""
    slot: torch.Tensor    # (G, C) long: the slot chain c of group g unrolls at
    tokens: torch.Tensor  # (G, C, steps - 1) long: the token chain c reads at step j >= 1 is tokens[g, c, j - 1]
    read: torch.Tensor    # (P, 3) long: (step, group, chain) of each state read out
    row: Optional[torch.Tensor] = None  # (G,) long: the row whose step 0 group g's chains read; None: row g (G = B)

    @property
    def steps(self) -> int:
        return self.tokens.shape[-1] + 1


class TTTMask:
    """The attention mask of one TTT unroll as an additive bias, built once and viewed at every step (the steps share
    its memory): over the T step-0 keys, 0 where `allow` permits and the dtype's minimum elsewhere, then 0 on each
    diagonal column. Adding the minimum is the fill it stands for: a query barred from every step-0 key attends to
    its diagonals only, or uniformly to every step-0 key when it has none (written out by _ttt_attend: a fused
    kernel's log-sum-exp cannot hold a row of minima exactly).
    allow (B|1, 1, n, T) bool; max_diagonals: the most diagonals a step of the unroll adds (steps - 1)."""

    def __init__(self, allow: torch.Tensor, max_diagonals: int):
        self.allow, self.max_diagonals = allow, max_diagonals
        self.barred = ~allow.any(-1, keepdim=True)  # (B|1, 1, n, 1): queries allowed no step-0 key (padding rows)
        self._bias: Optional[torch.Tensor] = None

    def bias(self, diagonals: int, dtype: torch.dtype) -> torch.Tensor:
        """(B|1, 1, n, T + diagonals) in `dtype`, a view of the one buffer."""
        T = self.allow.shape[-1]
        if self._bias is None or self._bias.dtype != dtype:
            width = -(-(T + self.max_diagonals) // 16) * 16  # rows 16-aligned: CUDA's kernels take the views uncopied
            bias = torch.zeros(*self.allow.shape[:-1], width, dtype=dtype, device=self.allow.device)
            bias[..., :T].masked_fill_(~self.allow, torch.finfo(dtype).min)
            self._bias = bias
        return self._bias[..., : T + diagonals]


@dataclass
class TTTRows:
    """Step 0 of a TTT unroll over right-padded rows: RoPE positions (B, T) (padding slots repeat the last real
    position), the real slots (B, T) bool and the causal mask over each row's real keys (B, 1, T, T)."""
    positions: torch.Tensor
    valid: torch.Tensor
    causal: torch.Tensor

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> "TTTRows":
        T = attention_mask.shape[1]
        valid = attention_mask.bool()
        causal = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()[None, None] & valid[:, None, None, :]
        return cls((attention_mask.long().cumsum(-1) - 1).clamp_min(0), valid, causal)


@dataclass
class TTTKeys:
    """The step-0 keys and values of one unroll in _ttt_attend's extended form, built once for all its later steps
    (each step reads the first T + j columns): k', v' (B, nh, T + J, hd + m) for at most J diagonals, m = J rounded
    up to 8. Step j's copies would otherwise be made again at every step, and each kept for backward."""
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def of(cls, k0: torch.Tensor, v0: torch.Tensor, max_diagonals: int) -> "TTTKeys":
        dtype = v0.dtype  # as _ttt_attend: one dtype for all
        B, nh, _, hd = v0.shape
        m = -(-max_diagonals // 8) * 8
        onehot = F.pad(torch.eye(max_diagonals, m, dtype=dtype, device=v0.device), (hd, 0)).expand(B, nh, -1, -1)
        return cls(torch.cat([F.pad(k0.to(dtype), (0, m)), onehot], dim=2),
                   torch.cat([F.pad(v0, (0, m)), onehot], dim=2))


def _ttt_attend(q, k0, v0, mask: TTTMask, diag_k, diag_v, scale: float,
                ext: Optional[TTTKeys] = None) -> torch.Tensor:
    """Training-time-test attention: queries q (B, nh, n, hd) over the step-0 keys/values k0, v0 (B, nh, T, hd) where
    `mask` permits, plus one diagonal per later step (diag_k / diag_v: j x (B, nh, n, hd), each query's own slot at
    steps 1..j). One softmax over both. -> (B, nh, n, hd), in v0's dtype.

    One fused scaled_dot_product_attention call, so no (n, T) score tensor is kept for backward. The j diagonals enter
    as j extra key columns whose scores the queries carry, in m >= j extra coordinates (a multiple of 8, the fused
    kernels' alignment):
        q' = [q | d_1 .. d_j | 0]   d_i = q . k_i, per query (the diagonal's raw score)
        k' = [k0 | 0] on the T step-0 keys, [0 | e_i] on column i (e_i: one-hot)      v' = the same with v0
    so q'.k' is q.k0 on the step-0 keys and d_i on column i, and the output's extra coordinate i is the diagonal's
    softmax weight p_i: out = out'[:hd] + sum_i p_i v_i. ext: k0, v0 already extended (TTTKeys.of, for at least j
    diagonals), shared by the unroll's steps."""
    dtype = v0.dtype  # under autocast q, k (RoPE in fp32) and v (a linear's output) can differ: one dtype for all
    q, k0 = q.to(dtype), k0.to(dtype)
    j = len(diag_k)
    bias = mask.bias(j, dtype)                                                         # (B|1, 1, n, T + j)
    if j == 0:
        out = F.scaled_dot_product_attention(q, k0, v0, attn_mask=bias, scale=scale)   # (B, nh, n, hd)
        return torch.where(mask.barred, v0.mean(2, keepdim=True), out)  # barred queries: uniform over the keys
    B, nh, n, hd = q.shape
    if ext is None:
        ext = TTTKeys.of(k0, v0, j)
    T = k0.shape[2]
    k_ext, v_ext = ext.k[:, :, : T + j], ext.v[:, :, : T + j]                          # (B, nh, T + j, hd + m)
    m = k_ext.shape[-1] - hd
    d = torch.cat([(q * kk.to(dtype)).sum(-1, keepdim=True) for kk in diag_k], dim=-1)  # (B, nh, n, j) raw scores
    q_ext = torch.cat([q, d, q.new_zeros(B, nh, n, m - j)], dim=-1)                   # (B, nh, n, hd + m)
    o = F.scaled_dot_product_attention(q_ext, k_ext, v_ext, attn_mask=bias, scale=scale)  # (B, nh, n, hd + m)
    out = o[..., :hd]
    for i, vv in enumerate(diag_v):
        out = out + o[..., hd + i: hd + i + 1] * vv.to(dtype)
    return out


def naive_ttt_attend(q, k0, v0, allow: torch.Tensor, diag_k, diag_v, scale: float) -> torch.Tensor:
    """_ttt_attend written out, the reference it is tested and measured against (tests/test_gpu_path.py,
    python -m benchmarks.ttt_memory): full (n, T) scores masked with the dtype's minimum where `allow`
    (B|1, 1, n, T) bool forbids, one softmax over the step-0 block and the diagonals. (B, nh, n, hd)"""
    T = k0.shape[2]
    s0 = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~allow, torch.finfo(q.dtype).min)  # (B, nh, n, T)
    diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in diag_k]                     # j x (B, nh, n, 1)
    p = torch.cat([s0] + diag, dim=-1).float().softmax(-1).to(q.dtype)
    out = p[..., :T] @ v0
    for i, vv in enumerate(diag_v):
        out = out + p[..., T + i: T + i + 1] * vv
    return out


class Eagle3Head(DraftVocabMaps, nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embeddings, frozen
        self.fc = nn.Linear(len(c.aux_layer_ids or [0, 0, 0]) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # A buffer, so it moves with the module (no copy per step); not saved (rebuilt from the config); kept fp32
        # whatever the module's dtype (_apply), since bf16 frequencies would rotate far positions wrongly.
        inv_freq, self.rope_attention_factor = rope_inv_freq(c)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        self.register_vocab_maps(c.vocab_size, c.draft_vocab_size)

    def _apply(self, fn, recurse=True):
        """Module.to / .bfloat16 / .cuda: every tensor follows, except that the RoPE frequencies stay fp32 (exact,
        rebuilt from the config when a dtype change touched them)."""
        super()._apply(fn, recurse)
        if self.rope_inv_freq.dtype != torch.float32:
            self.rope_inv_freq = rope_inv_freq(self.config)[0].to(self.rope_inv_freq.device)
        return self

    def features(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, 3Ht) target features -> (B, T, H) fused, cast to the head's dtype first (an fp32 target's features
        feed a bf16 head under DeepSpeed, where no autocast casts them)."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    # ------------------------------------------------------------------ one layer application
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(B, n) -> (B, n, H): the target's input embedding (weight rows times the scale, in the weight's dtype,
        as HF's scaled embeddings compute it)."""
        e = self.embed_tokens(token_ids)
        c = self.config.embed_scale
        return e if c == 1.0 else e * torch.tensor(c, dtype=e.dtype, device=e.device)

    def _layer(self, token_ids, g, position_ids, attend):
        """token_ids (B, n), g (B, n, H), positions (B, n); attend(q, k, v) -> (B, nh, n, hd). Returns out, k, v."""
        L = self.midlayer
        x = torch.cat([L.input_layernorm(self.embed(token_ids)), L.hidden_norm(g)], dim=-1)  # (B, n, 2H)
        cos, sin = rope_cos_sin(position_ids, self.rope_inv_freq, self.rope_attention_factor, x.dtype)
        q, k, v = L.self_attn.qkv(x, cos, sin)
        a = attend(q, k, v)  # (B, nh, n, hd)
        B, _, n, _ = a.shape
        h = g + L.self_attn.o_proj(a.transpose(1, 2).reshape(B, n, -1))
        h = h + L.mlp(L.post_attention_layernorm(h))
        return h, k, v

    # ------------------------------------------------------------------ training: training-time test unroll
    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of pre-norm features: h (..., H) -> (..., Vd)."""
        return self.lm_head(self.norm(h))

    def forward(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                steps: int = 1, readout_at: Optional[list[torch.Tensor]] = None,
                chains: Optional[ChainQuery] = None, score: Optional[Callable] = None, checkpoint: bool = False):
        """TTT unroll. aux_hidden (B, T, 3Ht), input_ids/attention_mask (B, T), right-padded.
        Returns per-step logits [(B, T, Vd)] * steps; step j at slot t reads token t+1+j and predicts token t+2+j.
        readout_at: per step a (B, T) bool mask of the slots that are scored; then step j returns only their logits
        (N_j, Vd). The lm_head is about half of a step's FLOPs and prompt slots score nothing.
        chains: the sparse unroll instead (unroll_chains over chains.steps steps), returning the (P, Vd) logits of
        the states chains.read names. Every training computation runs inside forward, so DDP / FSDP / DeepSpeed
        wrappers see every parameter used and sync its gradients.
        score: score(j, features (N_j, H) after the final norm, lm_head weight (Vd, H)) in place of step j's readout,
        whose result step j returns: a fused loss computes the logits chunk by chunk and never keeps them.
        checkpoint: each step's layer keeps only its inputs and recomputes its activations in backward (one more
        layer forward per step for most of the unroll's activation memory).

        Attention at step j: slot t sees step-0 keys at slots <= t plus the keys of steps 1..j at slot t only
        (one diagonal per step), which is what the head sees at inference after drafting j tokens past t.
        """
        if chains is not None:
            hidden = torch.stack(self.unroll_chains(aux_hidden, input_ids, attention_mask, chains.slot, chains.tokens,
                                                    chains.steps, chains.row))   # (steps, G, C, H)
            r = chains.read
            return self.readout(hidden[r[:, 0], r[:, 1], r[:, 2]])              # (P, Vd)
        scale = 1.0 / math.sqrt(self.config.head_dim)
        rows = TTTRows.of(attention_mask)
        mask = TTTMask(rows.causal, steps - 1)
        g = self.features(aux_hidden)  # (B, T, H)
        keys, values, logits, ext = [], [], [], None
        for j in range(steps):
            tokens = torch.roll(input_ids, -(1 + j), dims=1)  # token t+1+j at slot t (wrapped slots are masked out)
            if j == 1:
                ext = TTTKeys.of(keys[0], values[0], steps - 1)
            args = (mask, scale, tokens, g, rows.positions + j, list(keys), list(values), ext)
            g, k, v = (torch.utils.checkpoint.checkpoint(self._ttt_step, *args, use_reentrant=False,
                                                         context_fn=checkpoint_contexts)  # recompute: not MFU's
                       if checkpoint else self._ttt_step(*args))
            keys.append(k), values.append(v)
            h = g if readout_at is None else g[readout_at[j]]
            logits.append(self.readout(h) if score is None else score(j, self.norm(h), self.lm_head.weight))
        return logits

    def _ttt_step(self, mask: TTTMask, scale: float, token_ids, g, position_ids, keys: list, values: list,
                  ext: Optional[TTTKeys] = None):
        """Step j = len(keys) of the unroll over every slot: queries attend to the step-0 block (causal) and one
        diagonal per earlier step; keys / values: the earlier steps' j x (B, nh, T, hd). A function of its inputs
        alone, so a checkpoint can recompute it. -> out (B, T, H), k, v (B, nh, T, hd)"""

        def attend(q, k, v):  # q (B, nh, T, hd)
            ks, vs = keys + [k], values + [v]
            return _ttt_attend(q, ks[0], vs[0], mask, ks[1:], vs[1:], scale, ext)

        return self._layer(token_ids, g, position_ids, attend)

    def unroll_chains(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      slot: torch.Tensor, tokens: torch.Tensor, steps: int,
                      row: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """The TTT unroll of `forward`, sparse: step 0 at every slot (its keys are what later steps attend to), steps
        1..steps-1 only along C chains per row. Returns pre-norm hidden states [(B, C, H)] * steps: entry j is step
        j's output at each chain's slot, which is `forward`'s step-j feature there when the chain's tokens are the
        row's own (readout(h) = its logits).

        aux_hidden (B, T, 3Ht), input_ids / attention_mask (B, T) right-padded, as `forward`;
        slot (B, C) long: the slot chain c of row b unrolls at; tokens (B, C, steps-1): the token chain c reads at
        step j >= 1 is tokens[b, c, j-1] (`forward` reads input_ids[b, slot+1+j]). A chain's tokens may leave the
        row after slot+1 (a branch: drafts after a rejection), since step j at a slot attends only to step-0 keys at
        slots <= it and to the chain's own keys of steps 1..j. Padding chains (any valid slot) are computed and
        ignored. Cost: one layer over B x T slots plus (steps-1) layers over B x C, instead of steps x B x T.
        row (G,) long: the chains come in G groups, group g on row row[g] (slot, tokens and the result are (G, C, ...)):
        a row with many chains spans several groups and one with few fills one, so C is not the busiest row's count
        (None: group g is row g)."""
        B, T = input_ids.shape
        scale = 1.0 / math.sqrt(self.config.head_dim)
        rows = TTTRows.of(attention_mask)
        step0 = {}

        def attend0(q, k, v):  # step 0: causal over the row, as `forward`
            step0["k"], step0["v"] = k, v
            return _ttt_attend(q, k, v, TTTMask(rows.causal, 0), [], [], scale)

        g1, _, _ = self._layer(torch.roll(input_ids, -1, dims=1), self.features(aux_hidden), rows.positions, attend0)
        H = g1.shape[-1]
        of_group = (lambda x: x) if row is None else (lambda x: x[row])        # (B, ...) -> (G, ...)
        h = of_group(g1).gather(1, slot[..., None].expand(*slot.shape, H))     # (G, C, H)
        out = [h]
        if steps == 1:
            return out
        chain_pos = of_group(rows.positions).gather(1, slot)                    # (G, C)
        key_ok = (torch.arange(T, device=slot.device)[None, None] <= slot[..., None]) \
            & of_group(rows.valid)[:, None, :]                                  # (G, C, T)
        chain_mask = TTTMask(key_ok[:, None], steps - 1)
        k0, v0 = of_group(step0["k"]), of_group(step0["v"])                    # (G, nh, T, hd)
        ext = TTTKeys.of(k0, v0, steps - 1)
        diag_k, diag_v = [], []

        def attend(q, k, v):  # q (G, nh, C, hd): step-0 keys at slots <= the chain's, then one diagonal per step
            diag_k.append(k), diag_v.append(v)
            return _ttt_attend(q, k0, v0, chain_mask, diag_k, diag_v, scale, ext)

        for j in range(1, steps):
            h, _, _ = self._layer(tokens[:, :, j - 1], h, chain_pos + j, attend)
            out.append(h)
        return out

    # ------------------------------------------------------------------ inference: one call per draft step
    def step(self, token_ids: torch.Tensor, g: torch.Tensor, position_ids: torch.Tensor,
             past: tuple[torch.Tensor, torch.Tensor] | SlotCache | None = None,
             key_mask: Optional[torch.Tensor] = None, readout_slot: Optional[torch.Tensor] = None,
             query_mask: Optional[torch.Tensor] = None) -> Eagle3StepOutput:
        """Append n slots to a cache. token_ids (B, n), g (B, n, H) (fc-fused target features or the head's own
        previous output), position_ids (B, n); past: keys/values (B, nh, S, hd), concatenated into new tensors, or a
        SlotCache, appended to in place; key_mask (B, S + n) bool marks
        usable cache slots. New slots attend causally among themselves and to every usable past slot.
        readout_slot (B,): logits only at that slot of each row, (B, 1, Vd) (a drafter needs one slot per row; the
        lm_head over every slot of a prompt-long block is most of a drafting round's work). Default: every slot.
        query_mask (B, n, S + n) bool: the keys each new slot attends to, in place of the causal rule and key_mask
        (token trees: a drafted node sees the usable cache, its ancestors and itself, not its siblings)."""
        scale = 1.0 / math.sqrt(self.config.head_dim)
        store = {}

        def attend(q, k, v):
            if isinstance(past, SlotCache):
                K, Vv = past.append(k, v)
            else:
                K = k if past is None else torch.cat([past[0], k], dim=2)
                Vv = v if past is None else torch.cat([past[1], v], dim=2)
            S, n = K.shape[2] - k.shape[2], k.shape[2]
            allow = torch.ones(n, S + n, dtype=torch.bool, device=q.device)
            allow[:, S:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            allow = allow[None, None]
            if key_mask is not None:
                allow = allow & key_mask[:, None, None, :].bool()
            if query_mask is not None:
                allow = query_mask[:, None].bool()                              # (B, 1, n, S + n)
            s = (q @ K.transpose(-1, -2)) * scale
            s = s.masked_fill(~allow, torch.finfo(s.dtype).min)
            store["k"], store["v"] = K, Vv
            return s.float().softmax(-1).to(q.dtype) @ Vv

        h, _, _ = self._layer(token_ids, g, position_ids, attend)
        read = h if readout_slot is None else h[torch.arange(h.shape[0], device=h.device), readout_slot][:, None]
        return Eagle3StepOutput(h, self.readout(read), store["k"], store["v"])

    # ------------------------------------------------------------------ HF-style persistence (midlayer format)
    def save_pretrained(self, path, state_dict: Optional[dict] = None, safe_serialization: bool = True, **_) -> None:
        from specdistill.export import write_weights

        Path(path).mkdir(parents=True, exist_ok=True)
        write_weights(path, state_dict if state_dict is not None else self.state_dict(), self.config.to_hf_dict())

    @classmethod
    def from_pretrained(cls, path) -> "Eagle3Head":
        from safetensors.torch import load_file

        path = Path(path)
        head = cls(Eagle3Config.from_hf_dict(json.loads((path / "config.json").read_text())))
        sd = load_file(str(path / "model.safetensors"))
        own = head.state_dict()
        misshapen = [f"{k} {tuple(v.shape)} (its config.json makes {tuple(own[k].shape)})" for k, v in sd.items()
                     if k in own and v.shape != own[k].shape]
        if misshapen:
            raise ValueError(f"EAGLE-3 checkpoint {path}: its config.json disagrees with its tensors: "
                             f"{'; '.join(misshapen[:4])}{' ...' if len(misshapen) > 4 else ''}. Restore the "
                             "config.json saved with these weights (sizes: hidden_size, intermediate_size, "
                             "num_attention_heads, num_key_value_heads, vocab_size, draft_vocab_size)")
        missing, unexpected = head.load_state_dict(sd, strict=False)
        # engines reuse the target's embeddings; a full-vocabulary head's vLLM export has no vocab maps (the
        # head's identity maps stand)
        optional = {"embed_tokens.weight"} | ({"d2t", "t2d"} if head.config.draft_vocab_size == head.config.vocab_size
                                               else set())
        missing = [k for k in missing if k not in optional]
        if missing or unexpected:
            raise ValueError(f"EAGLE-3 checkpoint {path} does not match the head: missing {missing}, unexpected "
                             f"{unexpected}")
        return head


def build_eagle3(target_model, draft_vocab: torch.Tensor, aux_layer_ids: Optional[list[int]],
                 output_from_target: bool = False, intermediate_size: Optional[int] = None) -> Eagle3Head:
    """A fresh head for this target: embeddings copied (frozen), vocab mapping set, fc/midlayer random.
    output_from_target: the head's final norm and lm_head start as the target's (its lm_head rows of the draft
    vocabulary), so the head's output space starts as the target's own readout (the logit lens) instead of random.
    intermediate_size: the head's MLP width (null: the target's); the one size a head can change, since its width is
    the target's hidden size (it reads the target's embeddings) and serving engines load exactly one layer."""
    L = target_model.config.num_hidden_layers
    aux = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(L)
    bad = [k for k in aux if not 0 <= k < L]  # not L: vLLM's stream L is pre-final-norm, HF's hidden_states[L] is not
    if bad or len(aux) != 3:
        raise ValueError(f"target.aux_layer_ids={aux}: EAGLE-3 needs 3 ids in [0, {L - 1}] (vLLM convention: k = "
                         f"hidden_states[k], 0 = embeddings); for this target try {default_aux_layer_ids(L)}")
    from specdistill.models.target import embedding_scale

    cfg = Eagle3Config.from_target(target_model.config, len(draft_vocab), aux, embedding_scale(target_model))
    if intermediate_size is not None:
        if intermediate_size < 1:
            raise ValueError(f"draft.intermediate_size={intermediate_size}: the head's MLP width must be >= 1")
        cfg.intermediate_size = int(intermediate_size)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        if output_from_target:
            head.lm_head.weight.copy_(target_model.get_output_embeddings().weight[draft_vocab.long()])
            final_norm = getattr(getattr(target_model, "model", target_model), "norm", None)
            if final_norm is not None and getattr(final_norm, "weight", None) is not None:
                head.norm.weight.copy_(rms_norm_gain(final_norm, target_model.config.hidden_size, cfg.rms_norm_eps))
    head.set_vocab(draft_vocab)
    return head


def rms_norm_gain(norm: nn.Module, hidden: int, eps: float) -> torch.Tensor:
    """(H,) the per-channel gain w of an RMS norm module, norm(x) = w * x / rms(x), read by applying it (Llama stores
    w, Gemma stores w - 1 and computes (1 + weight)), so the head's own RMSNorm reproduces it. Raises when the module
    is not such a norm (the head could not start from it)."""
    p = next(norm.parameters())
    with torch.no_grad():
        w = norm(torch.ones(1, hidden, dtype=p.dtype, device=p.device)).float()[0] * math.sqrt(1.0 + eps)
        x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0)).to(p)
        want = w * x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        if not torch.allclose(norm(x).float(), want, rtol=1e-3, atol=1e-5):
            raise ValueError(f"the target's final norm ({type(norm).__name__}) is not a per-channel RMS norm: "
                             "draft.output_from_target=true cannot copy it into the head; set it to false")
    return w
