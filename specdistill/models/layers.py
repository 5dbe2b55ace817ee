"""Building blocks shared by the draft models (EAGLE-3 heads, DFlash drafts): RMSNorm, the gated (SwiGLU) MLP and the
target's RoPE. They know nothing of any draft kind; parameter names are the Llama/Qwen ones engines load."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):  # (..., n)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the Llama / Qwen MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(c, who: str) -> tuple[torch.Tensor, float]:
    """(inv_freq (hd/2,), attention_factor) of the target's RoPE for a draft config `c` (rope_scaling, rope_theta,
    head_dim, hidden_size, num_attention_heads, max_position_embeddings), scaling included (llama3, linear, yarn, ...),
    computed by transformers' own ROPE_INIT_FUNCTIONS so the draft rotates exactly as the target and the serving engine
    do. Length-dependent types (dynamic, longrope) are refused: engines apply them per request. who: named in errors."""
    rp = dict(c.rope_scaling or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        hd = c.head_dim
        return 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)), 1.0
    if kind in ("dynamic", "longrope"):
        raise ValueError(f"{who}: RoPE scaling {kind!r} depends on the sequence length and is not supported; "
                         "use a target config with default, linear, llama3 or yarn RoPE")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"{who}: unknown RoPE scaling type {kind!r}; transformers knows {sorted(ROPE_INIT_FUNCTIONS)}")
    rp.pop("type", None)
    rp.update(rope_type=kind, rope_theta=c.rope_theta)
    cfg = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                      max_position_embeddings=c.max_position_embeddings, rope_parameters=rp)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    return inv_freq.float(), float(factor)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float,
                 dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, T, hd) for integer positions (B, T); the Llama (rotate_half) convention."""
    freqs = position_ids.float()[..., None] * inv_freq.to(position_ids.device)  # (B, T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def apply_rope(x, cos, sin):  # x (B, h, T, hd), cos/sin (B, T, hd)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]
