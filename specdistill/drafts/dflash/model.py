"""DFlash block drafter (Chen et al. 2026, "DFlash: block diffusion for flash speculative decoding"): a few
transformer layers that propose a whole block of B-1 tokens in ONE non-causal forward, conditioned on the target's
hidden states injected as keys and values into every layer.

This module knows nothing of decoding, training or the target model object: it maps (target features, anchor
tokens, positions) to hidden states and logits.

The computation, for a block anchored at position a (the last verified token x_a; the target has run on x_0 .. x_{a-1}):
  context   c_j = hidden_norm(fc(concat_l h^l_j)), j < a      h^l: the target's hidden_states[l + 1], l in
                                                                target_layer_ids (the output of decoder layer l)
  query     [x_a, MASK, ..., MASK] (B tokens) embedded with the target's frozen embedding, positions a .. a+B-1
  layer i   keys/values = [k_norm(k_proj_i(c_j)), v_proj_i(c_j)] for the context (RoPE at j), then the block's own
            [k_norm(k_proj_i(x)), v_proj_i(x)]; queries q_norm(q_proj_i(x)); every block position sees the whole
            context and the whole block (non-causal); pre-norm residual layer with a SiLU MLP, as Qwen3
  readout   logits_k = lm_head(norm(x_k)) with the target's frozen LM head: block position k (1 .. B-1) proposes x_{a+k}
The context keys of a layer depend only on the target's features, never on the block, so a decoder caches them per
layer and adds only the verified tokens' rows each round (decoding.py). With `sliding_window` W, a block sees only the
W context positions before its anchor (a - W .. a - 1).

Checkpoint layout (config.json + model.safetensors), chosen so the folder is the one vLLM's DFlash model
(vllm/model_executor/models/qwen3_dflash.py, speculative method "dflash") loads; export.py writes it without the
frozen embedding and LM head (a reduced vocabulary's LM head rows excepted), which vLLM takes from the target:
  config.json   architectures ["DFlashDraftModel"], model_type "qwen3", the Qwen3 sizes (hidden_size, num_hidden_layers,
                num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta,
                rope_scaling, max_position_embeddings, vocab_size, hidden_act "silu", attention_bias false),
                draft_vocab_size (Vd: the LM head rows it reads out, V unless a reduced draft vocabulary),
                block_size (B: vLLM drafts num_speculative_tokens = B - 1 per round), num_target_layers,
                target_hidden_size, and dflash_config {mask_token_id, target_layer_ids} (the keys vLLM reads for the
                mask token and for the target layers whose outputs it captures; target_layer_ids count decoder layers
                from 0, so layer l is hidden_states[l + 1]); eagle_aux_hidden_state_layer_ids (the same layers in
                hidden_states numbering, which vLLM reads first when present); with a window, dflash_config.use_swa
                and swa_window_size. Our own fields (embed_scale, final_logit_softcapping) are ignored by vLLM.
  tensors       fc.weight [H, K*Ht], hidden_norm.weight [H], norm.weight [H],
                layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight [hd],
                layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.{input,post_attention}_layernorm.weight,
                embed_tokens.weight [V, H] and lm_head.weight [Vd, H] (frozen copies of the target's; the export
                leaves them to vLLM, which shares the target's, except a reduced vocabulary's lm_head), d2t [Vd] int64
                (target id = draft id + d2t[draft id], vLLM's draft_id_to_target_id; exported when Vd < V), t2d [V]
                bool (the target ids kept; ours only).
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from specdistill.models.layers import GatedMLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from specdistill.models.vocab import DraftVocabMaps

ARCHITECTURE = "DFlashDraftModel"


@dataclass
class DFlashConfig:
    hidden_size: int               # H: the target's (the draft reads its embeddings and LM head)
    intermediate_size: int
    num_hidden_layers: int         # draft layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int                # V, the target's
    draft_vocab_size: int          # Vd: the rows of the LM head it reads out (V: all; fewer: the d2t map below)
    target_hidden_size: int        # Ht
    num_target_layers: int         # the target's decoder layers (target_layer_ids are checked against it)
    block_size: int                # B: one forward proposes B - 1 tokens
    mask_token_id: int             # the token filling block positions 1 .. B-1
    target_layer_ids: list[int] = field(default_factory=list)  # decoder layers (0-based); features = hidden_states[l+1]
    sliding_window: Optional[int] = None  # a block sees the last W context positions; None: all of them
    rope_scaling: Optional[dict] = None
    embed_scale: float = 1.0       # the target's embedding module multiplies rows by this (Gemma: sqrt(H))
    final_logit_softcapping: Optional[float] = None  # the target's final soft cap (Gemma-2), applied to the readout

    def __post_init__(self):
        check_settings(self.block_size, self.target_layer_ids, self.mask_token_id, self.num_target_layers,
                       self.vocab_size, self.sliding_window)

    @property
    def aux_layer_ids(self) -> list[int]:
        """The target's hidden_states ids the draft reads (vLLM's aux-layer numbering: l + 1)."""
        return [l + 1 for l in self.target_layer_ids]

    def to_hf_dict(self) -> dict:
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.sliding_window is not None:
            dflash.update(use_swa=True, swa_window_size=self.sliding_window)
        d = {"architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": self.hidden_size,
             "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
             "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
             "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
             "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
             "draft_vocab_size": self.draft_vocab_size, "hidden_act": "silu", "attention_bias": False,
             "tie_word_embeddings": False,
             "target_hidden_size": self.target_hidden_size, "num_target_layers": self.num_target_layers,
             "block_size": self.block_size, "dflash_config": dflash,
             "eagle_aux_hidden_state_layer_ids": self.aux_layer_ids, "torch_dtype": "float32"}
        if self.rope_scaling:
            d["rope_scaling"] = self.rope_scaling
        if self.embed_scale != 1.0:
            d["embed_scale"] = self.embed_scale
        if self.final_logit_softcapping:
            d["final_logit_softcapping"] = self.final_logit_softcapping
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DFlashConfig":
        dflash = d.get("dflash_config") or {}
        return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
                   num_key_value_heads=d["num_key_value_heads"],
                   head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                   rms_norm_eps=d["rms_norm_eps"], rope_theta=d.get("rope_theta", 10000.0),
                   max_position_embeddings=d["max_position_embeddings"], vocab_size=d["vocab_size"],
                   draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                   target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
                   num_target_layers=d["num_target_layers"], block_size=d["block_size"],
                   mask_token_id=dflash["mask_token_id"], target_layer_ids=list(dflash["target_layer_ids"]),
                   sliding_window=dflash.get("swa_window_size") if dflash.get("use_swa") else None,
                   rope_scaling=d.get("rope_scaling"), embed_scale=float(d.get("embed_scale", 1.0)),
                   final_logit_softcapping=d.get("final_logit_softcapping"))


def check_settings(block_size: int, target_layer_ids: Optional[list[int]], mask_token_id: Optional[int],
                   num_target_layers: Optional[int], vocab_size: Optional[int],
                   sliding_window: Optional[int] = None) -> None:
    """Refuse DFlash settings by name (the draft config's keys); the target's sizes may be None (not known yet)."""
    if block_size < 2:
        raise ValueError(f"draft.dflash.block_size={block_size}: a block is [anchor, MASK x (B-1)], so B must be >= 2 "
                         "(B=2 drafts one token per round); typical values are 4, 8 or 16")
    if target_layer_ids is not None:
        ids = list(target_layer_ids)
        if not ids:
            raise ValueError("draft.dflash.target_layer_ids is empty: list the target's decoder layers to read "
                             "(or null for evenly spread defaults)")
        if ids != sorted(set(ids)):
            raise ValueError(f"draft.dflash.target_layer_ids={ids} must be strictly ascending (vLLM concatenates the "
                             "layers in layer order)")
        if num_target_layers is not None:
            bad = [l for l in ids if not 0 <= l <= num_target_layers - 2]
            if bad:
                raise ValueError(f"draft.dflash.target_layer_ids {bad} out of range for a target with "
                                 f"{num_target_layers} decoder layers: use ids in [0, {num_target_layers - 2}] (layer "
                                 "l's output is hidden_states[l + 1]; the last layer's output is never captured)")
    if mask_token_id is not None and vocab_size is not None and not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"draft.dflash.mask_token_id={mask_token_id} is outside the target's vocabulary "
                         f"[0, {vocab_size - 1}]: pick an id of the target's tokenizer (null: the last id)")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"draft.dflash.sliding_window={sliding_window} must be >= 1 (or null: full context)")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """max(num_draft_layers, 3) decoder layers spread evenly over [1, L-3] (clamped into [0, L-2] for shallow
    targets), low to high, like the reference drafts: one feature per draft layer, at least low / middle / high."""
    L, n = num_target_layers, max(num_draft_layers, 3)
    lo, hi = min(1, max(L - 2, 0)), max(L - 3, 0)
    if hi <= lo:
        return sorted({min(max(l, 0), max(L - 2, 0)) for l in range(lo, lo + n)})
    ids = sorted({round(lo + (hi - lo) * i / (n - 1)) for i in range(n)})
    return ids


def rope_frequencies(c: DFlashConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq (hd/2,), attention factor) of the target's RoPE (models/layers.rope_inv_freq)."""
    return rope_inv_freq(c, "DFlash draft")


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """RoPE (rotate-half convention) of x (N, h, S, hd) at integer positions (N, S)."""
    cos, sin = rope_cos_sin(positions, inv_freq, factor, x.dtype)             # (N, S, hd)
    return apply_rope(x, cos, sin)


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, positions: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, S, H) at positions (N, S) -> k, v (N, nkv, S, hd): K-norm then RoPE on the keys."""
        N, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(N, S, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(N, S, self.nkv, self.hd).transpose(1, 2)
        return rotate(k, positions, *rope), v


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)


@dataclass
class ContextKV:
    """The injected context of every layer for N rows: keys/values (N, nkv, S, hd) per layer (K-normed, RoPE applied),
    their positions (N, S) and which slots are real (N, S) bool."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    valid: torch.Tensor

    def rows(self, idx: torch.Tensor) -> "ContextKV":
        """The context of rows idx (G,) long, in that order (a row may repeat)."""
        return ContextKV([k[idx] for k in self.keys], [v[idx] for v in self.values], self.positions[idx],
                         self.valid[idx])


class DFlashDraft(DraftVocabMaps, nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size).requires_grad_(False)  # the target's, frozen
        # the target's LM head rows of the draft vocabulary, frozen; d2t / t2d map draft ids to target ids (offsets:
        # target = draft + d2t[draft], as vLLM reads them) and mark the target ids kept
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False).requires_grad_(False)
        self.register_vocab_maps(c.vocab_size, c.draft_vocab_size)
        inv_freq, self.rope_factor = rope_frequencies(c)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        """dtype / device moves: the RoPE frequencies stay fp32 (bf16 frequencies rotate far positions wrongly)."""
        super()._apply(fn, recurse)
        if self.rope_inv_freq.dtype != torch.float32:
            self.rope_inv_freq = rope_frequencies(self.config)[0].to(self.rope_inv_freq.device)
        return self

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ------------------------------------------------------------------------------------------- pieces
    def context(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> ContextKV:
        """Target features (N, S, K*Ht) at positions (N, S), valid (N, S) bool -> every layer's injected keys/values."""
        x = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))           # (N, S, H)
        rope = (self.rope_inv_freq, self.rope_factor)
        keys, values = zip(*(layer.self_attn.kv(x, positions, rope) for layer in self.layers))
        return ContextKV(list(keys), list(values), positions, valid.bool())

    def blocks(self, ctx: ContextKV, anchors: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
        """n blocks per row over the row's context: anchors, anchor_pos (N, n) -> final-normed hidden (N, n, B, H).

        Block i of row r queries [anchors[r, i], MASK x (B-1)] at positions anchor_pos[r, i] + 0 .. B-1; it attends to
        the row's valid context slots at positions < anchor_pos[r, i] (and >= anchor_pos - W with a window) and to
        its own B positions, never to another block."""
        c = self.config
        N, n = anchors.shape
        B = c.block_size
        k_ar = torch.arange(B, device=anchors.device)
        tokens = torch.full((N, n, B), c.mask_token_id, dtype=torch.long, device=anchors.device)
        tokens[:, :, 0] = anchors
        x = (self.embed_tokens(tokens) * c.embed_scale).reshape(N, n * B, -1).to(self.fc.weight.dtype)  # (N, nB, H)
        pos = (anchor_pos[:, :, None] + k_ar).reshape(N, n * B)                    # (N, nB)
        # Who sees what: (N, nB, S) context part and (nB, nB) block-diagonal part.
        ctx_pos = ctx.positions[:, None, :]                                        # (N, 1, S)
        start = anchor_pos.repeat_interleave(B, dim=1)[:, :, None]                 # (N, nB, 1)
        see_ctx = ctx.valid[:, None, :] & (ctx_pos < start)
        if c.sliding_window is not None:
            see_ctx = see_ctx & (ctx_pos >= start - c.sliding_window)
        block_of = torch.arange(n, device=anchors.device).repeat_interleave(B)
        see_block = (block_of[:, None] == block_of[None, :]).expand(N, -1, -1)    # (N, nB, nB)
        allow = torch.cat([see_ctx, see_block], dim=-1)[:, None]                   # (N, 1, nB, S + nB)
        rope = (self.rope_inv_freq, self.rope_factor)
        scale = 1.0 / math.sqrt(c.head_dim)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(h).view(N, n * B, attn.nh, attn.hd)).transpose(1, 2)  # (N, nh, nB, hd)
            q = rotate(q, pos, *rope)
            k, v = attn.kv(h, pos, rope)                                           # (N, nkv, nB, hd)
            K = torch.cat([ctx.keys[i].to(k.dtype), k], dim=2)                     # (N, nkv, S + nB, hd)
            V = torch.cat([ctx.values[i].to(v.dtype), v], dim=2)
            rep = attn.nh // attn.nkv
            K, V = K.repeat_interleave(rep, dim=1), V.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, K.to(q.dtype), V.to(q.dtype), attn_mask=allow, scale=scale)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(N, n * B, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).view(N, n, B, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden (..., H) -> (..., Vd) through the target's LM head rows of the draft vocabulary (and
        its soft cap, if any)."""
        out = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        cap = self.config.final_logit_softcapping
        return out if not cap else torch.tanh(out / cap) * cap

    def forward(self, features: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor,
                anchor_pos: torch.Tensor, row: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Training form, right- or un-padded rows whose column j sits at position j: features (N, S, K*Ht),
        valid (N, S) bool, anchors / anchor_pos (N, n) -> hidden (N, n, B, H) (readout with `logits`).
        row (G,) long: the blocks come in G groups, group g over row row[g]'s context (anchors, anchor_pos and the
        result are (G, n, ...)), so a row with many blocks spans several groups (None: group g is row g)."""
        positions = torch.arange(features.shape[1], device=features.device).expand(features.shape[0], -1)
        ctx = self.context(features, positions, valid)
        return self.blocks(ctx if row is None else ctx.rows(row), anchors, anchor_pos)

    # ------------------------------------------------------------------------------------------- persistence
    def save_pretrained(self, path, state_dict: Optional[dict] = None, safe_serialization: bool = True, **_) -> None:
        from specdistill.export import write_weights

        Path(path).mkdir(parents=True, exist_ok=True)
        write_weights(path, state_dict if state_dict is not None else self.state_dict(), self.config.to_hf_dict())

    @classmethod
    def from_pretrained(cls, path) -> "DFlashDraft":
        from safetensors.torch import load_file

        path = Path(path)
        model = cls(DFlashConfig.from_hf_dict(json.loads((path / "config.json").read_text())))
        missing, unexpected = model.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
        if missing or unexpected:
            raise ValueError(f"DFlash checkpoint {path} does not match the draft: missing {missing}, unexpected "
                             f"{unexpected} (an exported folder lacks the target's embedding and LM head: load the "
                             "training checkpoint's draft folder)")
        return model


def with_block_size(model: DFlashDraft, block_size: int) -> DFlashDraft:
    """The same draft (shared parameters) proposing block_size - 1 tokens per forward: a view with another block size,
    for measuring block sizes (a draft trained at one block size runs off its training distribution at another)."""
    check_settings(block_size, None, None, None, None)
    view = copy.copy(model)  # a shallow copy: the same parameter and buffer objects
    view.config = replace(model.config, block_size=block_size)
    return view


def build_dflash(target_model, num_layers: int, block_size: int, target_layer_ids: Optional[list[int]],
                 mask_token_id: Optional[int], intermediate_size: Optional[int] = None,
                 sliding_window: Optional[int] = None, vocab: Optional[torch.Tensor] = None) -> DFlashDraft:
    """A fresh DFlash draft for an HF causal LM target: its sizes, RoPE, frozen embedding and LM head (only the rows
    of `vocab`, ascending target ids, when given: a reduced draft vocabulary)."""
    from specdistill.models.target import embedding_scale

    t = target_model.config
    L, V = t.num_hidden_layers, target_model.get_output_embeddings().weight.shape[0]
    ids = list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(L, num_layers)
    rope = dict(getattr(t, "rope_parameters", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):  # one RoPE per layer type: the full-attention one
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    theta = float(rope.get("rope_theta", getattr(t, "rope_theta", 10000.0)))
    scaled = rope.get("rope_type", "default") != "default"
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if scaled else None
    c = DFlashConfig(hidden_size=t.hidden_size, intermediate_size=intermediate_size or t.intermediate_size,
                     num_hidden_layers=num_layers, num_attention_heads=t.num_attention_heads,
                     num_key_value_heads=t.num_key_value_heads,
                     head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
                     rms_norm_eps=t.rms_norm_eps, rope_theta=theta, max_position_embeddings=t.max_position_embeddings,
                     vocab_size=V, draft_vocab_size=V if vocab is None else len(vocab),
                     target_hidden_size=t.hidden_size, num_target_layers=L, block_size=block_size,
                     mask_token_id=V - 1 if mask_token_id is None else mask_token_id, target_layer_ids=ids,
                     sliding_window=sliding_window, rope_scaling=scaling,
                     embed_scale=embedding_scale(target_model),
                     final_logit_softcapping=getattr(t, "final_logit_softcapping", None))
    draft = DFlashDraft(c)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        rows = target_model.get_output_embeddings().weight
        draft.lm_head.weight.copy_(rows if vocab is None else rows[vocab])
    if vocab is not None:
        draft.set_vocab(vocab)
    if getattr(target_model.get_output_embeddings(), "bias", None) is not None:
        raise ValueError("DFlash drafts share the target's LM head, and this target's has a bias, which vLLM's DFlash "
                         "layout has no place for; use draft=eagle3 or an LM draft for it")
    return draft
