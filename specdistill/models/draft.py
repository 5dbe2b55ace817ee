"""Standalone draft LMs: from a small config, from the target's first layers, or from a pretrained folder."""
from __future__ import annotations

import copy

import torch

from specdistill.config import DraftConfig
from specdistill.models.target import load_causal_lm, load_tokenizer


def build_draft(cfg: DraftConfig, target_model, data=None) -> torch.nn.Module:
    """Return a trainable causal LM sharing the target's vocabulary. `data` (TokenizedData): calibration rows for
    drafts that profile the target (init=moe_experts without a saved profile)."""
    tcfg = target_model.config
    if cfg.init == "moe_experts":
        from specdistill.moe.draft import build_from_config

        draft = build_from_config(cfg, target_model, data)
    elif cfg.init == "pretrained":
        if not cfg.path:
            raise ValueError("draft.init=pretrained needs draft.path=<HF folder or hub id>")
        draft = load_causal_lm(cfg.path, cfg.dtype)
    elif cfg.init == "from_target":
        n = cfg.num_layers
        if not 1 <= n <= tcfg.num_hidden_layers:
            raise ValueError(f"draft.num_layers={n} must be in [1, {tcfg.num_hidden_layers}] (the target's depth)")
        dcfg = copy.deepcopy(tcfg)
        dcfg.num_hidden_layers = n
        if getattr(dcfg, "layer_types", None):
            dcfg.layer_types = dcfg.layer_types[:n]
        draft = type(target_model)(dcfg)
        # Copies embeddings, the first n layers, final norm and head; the rest of the target's keys are unexpected.
        missing, _ = draft.load_state_dict(target_model.state_dict(), strict=False)
        missing = [k for k in missing if k not in _tied_keys(draft)]
        if missing:
            raise RuntimeError(f"draft built from the target is missing weights {missing[:5]}")
    elif cfg.init == "config":
        dcfg = copy.deepcopy(tcfg)
        dcfg.num_hidden_layers = cfg.num_layers
        if getattr(dcfg, "layer_types", None):
            dcfg.layer_types = dcfg.layer_types[:cfg.num_layers]
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            if getattr(cfg, key) is not None:
                setattr(dcfg, key, getattr(cfg, key))
        if cfg.hidden_size is not None and hasattr(dcfg, "head_dim"):
            dcfg.head_dim = dcfg.hidden_size // dcfg.num_attention_heads
        draft = type(target_model)(dcfg)
    else:
        raise ValueError(f"unknown draft.init {cfg.init!r}; choose from_target | config | pretrained | moe_experts")
    draft = draft.to(torch.float32 if cfg.dtype == "float32" else getattr(torch, cfg.dtype))
    check_vocab_compatible(draft.config, tcfg)
    draft.train()
    return draft


def _tied_keys(model) -> set[str]:
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()


def check_vocab_compatible(draft_config, target_config) -> None:
    dv, tv = draft_config.vocab_size, target_config.vocab_size
    if dv != tv:
        raise ValueError(f"draft vocab_size {dv} != target vocab_size {tv}: a standalone draft must share the target's "
                         "tokenizer and output layer size. Build it with draft.init=from_target or draft.init=config")


def check_tokenizers_match(draft_path: str, target_tokenizer) -> None:
    """A pretrained draft that ships its own tokenizer must map every token to the same id as the target's."""
    try:
        dtok = load_tokenizer(draft_path)
    except (OSError, ValueError):
        return  # no tokenizer shipped: the vocab_size check is all we can do
    dv, tv = dtok.get_vocab(), target_tokenizer.get_vocab()
    if dv != tv:
        diff = [t for t in list(tv)[:100000] if dv.get(t) != tv[t]][:5]
        raise ValueError(f"tokenizer mismatch between draft {draft_path!r} and the target ({len(dv)} vs {len(tv)} "
                         f"tokens; e.g. {diff} map differently). Speculative decoding needs identical tokenizers: "
                         "pick a draft trained with the target's tokenizer, or build one with draft.init=from_target")


def load_trained_draft(path: str):
    """A draft folder written by training: an EAGLE-3 head (midlayer format) or a standalone HF causal LM."""
    import json
    from pathlib import Path

    from specdistill.models.eagle3 import Eagle3Head

    cfg_file = Path(path) / "config.json"
    if cfg_file.exists() and "LlamaForCausalLMEagle3" in json.loads(cfg_file.read_text()).get("architectures", []):
        return Eagle3Head.from_pretrained(path)
    return load_causal_lm(path)
