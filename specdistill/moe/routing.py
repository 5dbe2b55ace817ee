"""Where an HF MoE model keeps its routers and experts, for the families whose router transformers exposes.

transformers 5.x gives Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE one layout: `layer.mlp` is a sparse block with
`gate` (a top-k router returning (router_logits, top_k_weights, top_k_index)) and `experts` (fused weights
`gate_up_proj` (E, 2I, H) in [gate; up] order and `down_proj` (E, H, I)). Qwen2-MoE adds an always-on
`shared_expert`; Qwen2/3-MoE may keep some layers dense (`mlp_only_layers`, `decoder_sparse_step`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts")  # Mixtral | Qwen2/3-MoE, OLMoE


def decoder_layers(model) -> nn.ModuleList:
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers"):
        raise ValueError(f"{type(model).__name__} has no .model.layers: not a decoder-only HF causal LM")
    return inner.layers


def is_moe_block(module) -> bool:
    router, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (router is not None and experts is not None and hasattr(router, "top_k")
            and isinstance(getattr(router, "weight", None), torch.Tensor)
            and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"))


def moe_blocks(model) -> dict[int, nn.Module]:
    """{target layer id: its sparse MoE block} (dense layers of mixed models are left out)."""
    blocks = {i: layer.mlp for i, layer in enumerate(decoder_layers(model)) if is_moe_block(layer.mlp)}
    for block in blocks.values():
        ex = block.experts
        if (getattr(ex, "is_transposed", False) or not getattr(ex, "is_concatenated", True)
                or getattr(ex, "has_bias", False)):
            raise NotImplementedError(f"{type(ex).__name__}: only the [gate; up] concatenated, untransposed, bias-free "
                                      "expert layout (Mixtral, Qwen2/3-MoE, OLMoE) is supported")
    return blocks


def require_moe(model) -> dict[int, nn.Module]:
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} ({model.config.model_type}) has no sparse MoE layers this toolkit "
                         "knows (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE in transformers 5.x): MoE drafts and routing "
                         "profiles need an MoE target")
    return blocks


def expert_count_key(config) -> str:
    for key in EXPERT_COUNT_KEYS:
        if key in type(config).__dict__.get("attribute_map", {}):
            continue  # an alias (OLMoE maps num_local_experts -> num_experts): set the real field
        if hasattr(config, key):
            return key
    raise ValueError(f"{type(config).__name__} has none of {EXPERT_COUNT_KEYS}")


def expert_intermediate_key(config) -> str:
    """The config field sizing one expert: moe_intermediate_size (Qwen) or intermediate_size (Mixtral, OLMoE)."""
    return "moe_intermediate_size" if hasattr(config, "moe_intermediate_size") else "intermediate_size"


def expert_forward(experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e of a fused experts module on tokens x (N, H) -> (N, H): down(act(gate(x)) * up(x))."""
    gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)  # (N, I) each
    return F.linear(experts.act_fn(gate) * up, experts.down_proj[e])


def route(router: nn.Module, x: torch.Tensor):
    """The router's own forward: (router_logits (N, E), top_k_weights (N, k), top_k_index (N, k))."""
    return router(x)
