"""Tiny MoE targets built from configs (Mixtral: top-k renormalised; Qwen3-MoE: norm_topk_prob=false, 8 experts),
saved as HF folders with the shared tiny chat tokenizer. Random init, no network, seconds."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import make_tokenizer, single_thread

_single_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def make_tiny_moe(kind: str, vocab_size: int, layers: int = 3, hidden: int = 32, seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    if kind == "mixtral":
        cfg = MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common)
        model = MixtralForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                             norm_topk_prob=False, head_dim=8, **common)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # a router that prefers some experts, so profiles are not flat
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.gate.weight[0] += 0.3
    return model.eval()


@pytest.fixture(scope="session")
def moe_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session", params=["mixtral", "qwen3_moe"])
def tiny_moe(request, moe_tokenizer):
    return make_tiny_moe(request.param, len(moe_tokenizer))


@pytest.fixture(scope="session")
def tiny_moe_dirs(tmp_path_factory, moe_tokenizer) -> dict:
    out = {}
    for kind in ("mixtral", "qwen3_moe"):
        d = tmp_path_factory.mktemp(f"tiny_{kind}")
        make_tiny_moe(kind, len(moe_tokenizer)).save_pretrained(d)
        moe_tokenizer.save_pretrained(d)
        out[kind] = d
    return out


def random_batch(vocab_size: int, B: int = 3, T: int = 12, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[-1, T - 3:] = 0  # right padding on one row
    loss = (torch.rand(B, T, generator=g) < 0.6).long() * attn
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}
