"""Draft adapter for standalone causal LMs sharing the target's vocabulary: built from a small config, from the
target's first layers, from a pretrained folder, or from the target's experts (MoE)."""
from __future__ import annotations

import copy
from typing import Optional

import torch

from specdistill.config import DraftConfig
from specdistill.decoding import Drafter, LMDrafter
from specdistill.decoding.kv import logits_dim, max_positions
from specdistill.drafts.base import DraftAdapter, chain_counts, min_sum
from specdistill.drafts.registry import SIZE_KEYS, register_kind
from specdistill.losses import acceptance_rate
from specdistill.models.target import load_causal_lm
from specdistill.moe.draft import build_from_config
from specdistill.tensors import pad_rows, position_ids
from specdistill.tokens import check_vocab_compatible


@register_kind(name="draft", inits={"from_target": (), "config": SIZE_KEYS, "pretrained": (), "moe_experts": ()},
               path_inits=("pretrained",), catch_all=True)
class LMDraft(DraftAdapter):
    """Any HF causal LM: drafts from its own KV cache, q over the target's vocabulary, served as its folder."""

    @classmethod
    def matches(cls, model: torch.nn.Module) -> bool:
        return isinstance(model, torch.nn.Module)  # the catch-all kind: tried last

    @classmethod
    def build(cls, draft_cfg, target, data) -> torch.nn.Module:
        return build_draft(draft_cfg, target.model, data)

    @classmethod
    def saved_in(cls, path) -> bool:
        return True  # the catch-all kind: any HF causal LM folder

    @classmethod
    def load(cls, path) -> torch.nn.Module:
        return load_causal_lm(path, setting="eval.draft_path")

    @classmethod
    def warm_start_overrides(cls, path) -> list[str]:
        return ["draft=pretrained", f"draft.path={path}"]

    @classmethod
    def card_section(cls, repo_id: str, target: str, exports: list[str], gamma: int) -> str:
        return f"""A standalone draft model (same tokenizer as the target):

```bash
# vLLM
vllm serve {target} --speculative-config '{{"model": "{repo_id}", "num_speculative_tokens": {gamma}}}'
# SGLang
python -m sglang.launch_server --model-path {target} --speculative-algorithm STANDALONE \\
    --speculative-draft-model-path {repo_id} --speculative-num-steps {gamma} --speculative-eagle-topk 1 \\
    --speculative-num-draft-tokens {gamma + 1}
```
"""

    def drafter(self, confidence: float = 0.0) -> Drafter:
        return LMDrafter(self.module, confidence=confidence)

    def check_target(self, target_model, why: str) -> None:
        check_vocab_compatible(logits_dim(self.module), logits_dim(target_model), why)

    def max_positions(self) -> Optional[int]:
        return max_positions(self.module)

    def logits_at(self, rows, row, context_len, index, features, pad_id: int, shares=None,
                  feature_row=None) -> torch.Tensor:
        return draft_logits_at(self.model, rows, row, context_len, pad_id)

    def alpha(self, p_logits, q_logits, temperature: float, q_temperature=None) -> torch.Tensor:
        return min_sum(p_logits, q_logits, temperature, q_temperature)

    def soft_alpha(self, p_logits, q_logits, temperature: float) -> torch.Tensor:
        return acceptance_rate(p_logits, q_logits, temperature)

    def chain_counts(self, target_out, batch: dict, gamma: int) -> torch.Tensor:
        q = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        match = q.argmax(-1) == target_out.logits.argmax(-1)  # (B, T)
        return chain_counts(match, batch["loss_mask"].bool(), gamma)


def draft_logits_at(model, rows: list[torch.Tensor], row: torch.Tensor, context_len: torch.Tensor,
                    pad_id: int) -> torch.Tensor:
    """(P, V) the draft's next-token logits after rows[row[p]][:context_len[p]], WITH grad, from ONE forward of the
    model's own __call__ (so a DDP/FSDP wrapper syncs gradients). Rows are left-padded (explicit position ids) so
    that each ends in the last column; the head runs only on the union of the needed columns (logits_to_keep),
    about max_new_tokens of them for rollout rows."""
    ids, mask = pad_rows(rows, pad_id, side="left")
    pos = position_ids(mask)
    L = ids.shape[1]
    lengths = torch.tensor([len(r) for r in rows], device=ids.device)
    col = L - lengths[row] + context_len - 1                                  # (P,) column of each position's logits
    keep, where = torch.unique(col, sorted=True, return_inverse=True)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=keep, use_cache=False)
    return out.logits[row, where]                                              # (P, V)


def build_draft(cfg: DraftConfig, target_model, data=None) -> torch.nn.Module:
    """Return a trainable causal LM sharing the target's vocabulary. `data` (TokenizedData): calibration rows for
    drafts that profile the target (init=moe_experts without a saved profile)."""
    tcfg = target_model.config
    if cfg.init == "moe_experts":
        draft = build_from_config(cfg, target_model, data)
    elif cfg.init == "pretrained":
        if not cfg.path:
            raise ValueError("draft.init=pretrained needs draft.path=<HF folder or hub id>")
        draft = load_causal_lm(cfg.path, cfg.dtype, setting="draft.path")
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
    check_vocab_compatible(draft.config.vocab_size, tcfg.vocab_size, "a standalone draft must share the target's "
                           "tokenizer and output layer size. Build it with draft.init=from_target or draft.init=config")
    draft.train()
    return draft


def _tied_keys(model) -> set[str]:
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
