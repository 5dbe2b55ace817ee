"""Grouped-query attention without copying the cache: transformers' SDPA path, except where it would repeat keys.

transformers' "sdpa" attention repeats every key and value head (repeat_kv) before calling
scaled_dot_product_attention whenever a mask is passed and more than one query is fed (the engines' verify forward:
[pending, d_1..d_K] over a padded batch), on CPU and CUDA alike. That copies the whole KV cache, g times over, in
every layer at every verification round: extra memory traffic of 2g x the cache's bytes where the step's floor reads
them once. Here the query heads that share a key/value head are folded into that head's query rows instead, so
attention reads the cache as it is:

    query (B, n_kv * g, q, hd) -> (B, n_kv, g * q, hd)     row r * q + i of group k = head k * g + r, query i
    mask  (B, 1, q, S)         -> (B, 1, g * q, S)         the same rows repeated per head of the group

The scores and their softmax are the same numbers the repeated call computes, row for row; the tests check the
logits. Every other case (no mask with several queries, which SDPA runs causally with its own grouped-query support;
a per-head mask; a position bias or softcap) goes to transformers' own function unchanged. Registered under
GROUPED_SDPA in transformers' AttentionInterface (its documented way to add an attention function), with sdpa's mask
format; models/target.py.load_causal_lm switches every grouped-query model that loaded with "sdpa" to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPED_SDPA = "sdpa_grouped"


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function protocol: query (B, H, q, hd), key / value (B, H_kv, S, hd), attention_mask
    None or (B|1, 1, q, S) -> (B, q, H, hd), None."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    q = query.shape[2]
    foldable = (groups > 1 and (attention_mask is not None or q == 1)
                and (attention_mask is None or attention_mask.shape[1] == 1)
                and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
                and not kwargs.get("output_attentions", False))
    if not foldable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    B, H, _, hd = query.shape
    folded = query.reshape(B, H // groups, groups * q, hd)                          # (B, H_kv, g * q, hd)
    mask = None if attention_mask is None else attention_mask.repeat(1, 1, groups, 1)  # (B|1, 1, g * q, S)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(B, H, q, value.shape[-1]).transpose(1, 2).contiguous(), None  # (B, q, H, hd)


def register_grouped_sdpa() -> None:
    """Make GROUPED_SDPA a name transformers resolves (idempotent): the function, and sdpa's mask format for it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_grouped_sdpa(model: torch.nn.Module) -> bool:
    """Switch a model that attends with "sdpa" and groups its query heads to GROUPED_SDPA; True when switched.
    Others stay as they loaded (eager, flash kernels, or one key/value head per query head, which repeats nothing)."""
    config = model.config.get_text_config(decoder=True)
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not heads or not kv_heads or kv_heads >= heads:
        return False
    register_grouped_sdpa()
    model.set_attn_implementation(GROUPED_SDPA)
    return model.config._attn_implementation == GROUPED_SDPA
