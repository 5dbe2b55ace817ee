"""Token-id rules shared by training, decoding and evaluation: which ids end a sequence, which id pads."""
from __future__ import annotations

from typing import Optional


def eos_ids(tokenizer, model, ignore_eos: bool) -> Optional[list[int]]:
    """The ids that end a generation: the model's generation_config eos ids and the tokenizer's, sorted (None when
    ignore_eos or when neither has one)."""
    if ignore_eos:
        return None
    ids = set()
    for src in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        if src is not None:
            ids.update([src] if isinstance(src, int) else src)
    return sorted(ids) or None


def pad_id(tokenizer, eos: Optional[list[int]] = None) -> int:
    """The id that fills padding: the tokenizer's pad id, else the first end-of-sequence id (`eos`, else the
    tokenizer's), else 0. Padded slots are always masked, so the choice only has to be a valid id."""
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if eos:
        return eos[0]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return 0


def check_vocab_compatible(draft_vocab: int, target_vocab: int, why: str, what: str = "draft") -> None:
    """A draft must score the target's token ids: equal vocabulary sizes, else a ValueError that says `why`."""
    if draft_vocab != target_vocab:
        raise ValueError(f"{what} vocab size {draft_vocab} != target vocab size {target_vocab}: {why}")
