"""A real-weight MoE without a model hub: SmolLM2-135M-Instruct upcycled into a Mixtral-style model.

Each dense MLP is copied into `num_experts` identical experts behind a seeded random router (top-k renormalised).
With identical experts and weights summing to 1 the MoE computes exactly the dense model's function, whatever the
router does: it exercises real-weight MoE code paths (loading, routing, profiling, drafting, expert losses), not
routing quality, and hot-expert selection cannot carry information on it.

    python -m specdistill.moe.upcycle [--out DIR] [--num-experts 4] [--top-k 2]
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch

from specdistill.assets import CACHE_ROOT, save_model_folder

SOURCE = "embedded:smollm2-135m-instruct"
DEFAULT_DIR = CACHE_ROOT / "models" / "smollm2-135m-moe4"  # conf/target/smollm2_moe.yaml points here


def mixtral_config(dense_config, num_experts: int, top_k: int, intermediate_size: int,
                   num_layers: Optional[int] = None):
    """The MixtralConfig of a dense Llama-family config turned into `num_experts` experts of `intermediate_size`
    neurons each, top-k renormalised routing, no jitter (shared by upcycling and moe/convert.py)."""
    from transformers import MixtralConfig

    d = dense_config
    rope = dict(getattr(d, "rope_parameters", None) or {"rope_type": "default", "rope_theta": d.rope_theta})
    return MixtralConfig(vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers or d.num_hidden_layers, num_attention_heads=d.num_attention_heads,
                         num_key_value_heads=d.num_key_value_heads, head_dim=getattr(d, "head_dim", None),
                         hidden_act=d.hidden_act, max_position_embeddings=d.max_position_embeddings,
                         rms_norm_eps=d.rms_norm_eps, rope_parameters=rope, sliding_window=None,
                         tie_word_embeddings=d.tie_word_embeddings, num_local_experts=num_experts,
                         num_experts_per_tok=top_k, router_jitter_noise=0.0, output_router_logits=False,
                         bos_token_id=d.bos_token_id, eos_token_id=d.eos_token_id, pad_token_id=d.pad_token_id,
                         attention_dropout=0.0)


NON_MLP_LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                         "self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")


def non_mlp_state(dense_state: dict, num_layers: int) -> dict:
    """Everything of a dense Llama state dict an MoE copies unchanged: embeddings, final norm, head, and each
    layer's attention and norms (the MLP is what upcycling / conversion replaces)."""
    sd = {k: v for k, v in dense_state.items() if ".layers." not in k}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        sd.update({p + name: dense_state[p + name] for name in NON_MLP_LAYER_WEIGHTS})
    return sd


def upcycle_llama(dense, num_experts: int = 4, top_k: int = 2, seed: int = 0, router_std: float = 0.05,
                  num_layers: Optional[int] = None):
    """A MixtralForCausalLM whose every layer holds `num_experts` copies of `dense`'s MLP (a Llama-family model)."""
    from transformers import MixtralForCausalLM

    d = dense.config
    L = num_layers or d.num_hidden_layers
    cfg = mixtral_config(d, num_experts, top_k, d.intermediate_size, L)
    cfg.specdistill_upcycled = {"source": getattr(d, "_name_or_path", ""), "num_experts": num_experts,
                                "top_k": top_k, "seed": seed, "router_std": router_std,
                                "note": "identical experts: the MoE computes the dense model exactly"}
    moe = MixtralForCausalLM(cfg).to(dense.dtype)
    gen = torch.Generator().manual_seed(seed)
    dsd = dense.state_dict()
    sd = non_mlp_state(dsd, L)
    for i in range(L):
        p = f"model.layers.{i}."
        gate_up = torch.cat([dsd[p + "mlp.gate_proj.weight"], dsd[p + "mlp.up_proj.weight"]], 0)  # (2I, H)
        sd[p + "mlp.experts.gate_up_proj"] = gate_up[None].repeat(num_experts, 1, 1)
        sd[p + "mlp.experts.down_proj"] = dsd[p + "mlp.down_proj.weight"][None].repeat(num_experts, 1, 1)
        router = torch.randn(num_experts, d.hidden_size, generator=gen) * router_std  # (E, H)
        sd[p + "mlp.gate.weight"] = router.to(dense.dtype)
    return load_moe_state(moe, sd, "upcycling")


def load_moe_state(moe, state: dict, what: str):
    """Load a complete MoE state dict built from a dense one (a tied head may be absent); any other gap is a bug."""
    missing, unexpected = moe.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and moe.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"{what} mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    moe.tie_weights()
    return moe.eval()


def ensure_upcycled(out: Path | str = DEFAULT_DIR, source: str = SOURCE, num_experts: int = 4, top_k: int = 2,
                    seed: int = 0, log=print) -> str:
    """Write the upcycled model + tokenizer to `out` once (atomic rename) and return the folder."""
    from specdistill.models.target import load_causal_lm, load_tokenizer

    out = Path(out).expanduser()
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return str(out)
    log(f"[specdistill] upcycling {source} into a {num_experts}-expert top-{top_k} MoE at {out} (once)")
    dense, tok = load_causal_lm(source, "float32"), load_tokenizer(source)
    moe = upcycle_llama(dense, num_experts, top_k, seed)
    save_model_folder(moe, tok, out)
    return str(out)


def ensure_default_target(path: str, log=print) -> None:
    """Scripts call this with target.path: the default upcycled folder is created when missing (other paths are
    left to the loader, which explains a missing folder itself)."""
    if Path(path).expanduser() == DEFAULT_DIR.expanduser():
        ensure_upcycled(DEFAULT_DIR, log=log)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DEFAULT_DIR))
    ap.add_argument("--num-experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(ensure_upcycled(a.out, num_experts=a.num_experts, top_k=a.top_k, seed=a.seed))


if __name__ == "__main__":
    main()

