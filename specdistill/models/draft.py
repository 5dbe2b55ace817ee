"""Loading trained drafts (an EAGLE-3 head or a standalone LM) and checking a pretrained draft's tokenizer."""
from __future__ import annotations

from specdistill.models.target import load_causal_lm, load_tokenizer


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
