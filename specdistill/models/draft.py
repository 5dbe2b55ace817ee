"""Checking a pretrained draft's tokenizer against the target's (loading a trained draft is its adapter's: drafts/)."""
from __future__ import annotations

from specdistill.models.target import load_tokenizer


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
