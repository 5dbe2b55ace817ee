"""Tiny random causal LMs, one per architecture family we test against: built from configs, fp32, seeded, in ms.

Each family keeps the attention layout that makes it different from Llama: Gemma-3 mixes sliding and full layers
(a hybrid cache), Mistral and Mixtral slide every layer, the MoE families route tokens through experts. Windows are
a few tokens so that any decoding test crosses the window boundary many times. The vocabulary matches
tests.conftest.make_tokenizer (320 tokens) unless vocab_size is overridden.

    model = tiny_target("gemma3", seed=1)                  # Gemma3ForCausalLM, layers sliding/full/sliding
    model = tiny_target("mistral", sliding_window=4)       # any config field can be overridden
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB_SIZE = 320  # len(tests.conftest.make_tokenizer())
SLIDING_WINDOW = 6

# Fields every family shares: 2 layers, hidden 32, 4 query heads over 2 KV heads of width 8.
_COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)

# arch -> (config class name, model class name, fields on top of _COMMON)
_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # Hybrid: sliding layers around a full one; Gemma's embedding scale sqrt(hidden), soft-capped logits, tied head.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=8, final_logit_softcapping=30.0,
        tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=SLIDING_WINDOW)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=SLIDING_WINDOW, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32, decoder_sparse_step=1)),
}
ARCHITECTURES: list[str] = list(_FAMILIES)
# Families whose tiny config has sliding-window layers (all of them, or mixed with full ones).
SLIDING_ARCHITECTURES: list[str] = [a for a, (_, _, f) in _FAMILIES.items() if f.get("sliding_window")]


def tiny_config(arch: str, vocab_size: int = VOCAB_SIZE, **overrides):
    """The tiny config of `arch` (one of ARCHITECTURES); overrides replace any field."""
    import transformers

    if arch not in _FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}; tiny ones exist for {ARCHITECTURES}")
    config_cls, _, fields = _FAMILIES[arch]
    # initializer_range 0.2 (HF: 0.02) makes random models' distributions peaked: greedy argmaxes are far from ties,
    # and two seeds agree on some tokens but not all (drafts get accepted and rejected).
    kwargs = {**_COMMON, "initializer_range": 0.2, **fields, "vocab_size": vocab_size, **overrides}
    return getattr(transformers, config_cls)(**kwargs)


def tiny_target(arch: str, seed: int = 0, vocab_size: int = VOCAB_SIZE, **overrides) -> torch.nn.Module:
    """A tiny random fp32 causal LM of `arch`, in eval mode; same seed and overrides -> same weights."""
    import transformers

    config = tiny_config(arch, vocab_size=vocab_size, **overrides)
    torch.manual_seed(seed)
    return getattr(transformers, _FAMILIES[arch][1])(config).float().eval()
