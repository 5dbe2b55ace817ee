"""Chat template rendering with an assistant-only loss mask, shifted together with the ids.

The mask is found from character spans, not from template markers, so it works for any chat template that
renders conversation prefixes as text prefixes (checked, with a clear error otherwise): the assistant span of turn
i runs from the end of render(messages[:i], add_generation_prompt=True) to the end of render(messages[:i+1]).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenizedConversation:
    input_ids: list[int]  # (T,)
    loss_mask: list[int]  # (T,) loss_mask[t] = 1 iff token t+1 is an assistant token (already shifted: predicts t+1)


def render(tokenizer, messages, add_generation_prompt: bool = False) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the target tokenizer has no chat template: pick a chat/instruct target or set "
                         "tokenizer.chat_template before building data")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    text = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        through = render(tokenizer, messages[: i + 1])
        if not text.startswith(before) or not text.startswith(through):
            raise ValueError("the chat template does not render conversation prefixes as text prefixes, so the "
                             "assistant-only mask cannot be located; use a template without per-turn rewriting")
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_conversation(tokenizer, messages, max_length: int) -> TokenizedConversation:
    """Tokenize with the template; mark assistant tokens; truncate to max_length; shift the mask by one."""
    text, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    is_assistant = [0] * len(ids)
    j = 0
    for t, (start, end) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        if j < len(spans) and start >= spans[j][0] and end <= spans[j][1] and end > start:
            is_assistant[t] = 1
    ids, is_assistant = ids[:max_length], is_assistant[:max_length]
    # Position t predicts token t+1, so its loss counts iff token t+1 is an assistant token. The last position
    # predicts nothing inside the sequence.
    loss_mask = is_assistant[1:] + [0]
    return TokenizedConversation(ids, loss_mask)


def prompt_ids(tokenizer, messages) -> list[int]:
    """The ids of a prompt rendered for generation (the user turn + assistant header)."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows of {input_ids, loss_mask} into a batch: input_ids/attention_mask/loss_mask (B, T)."""
    T = max(len(r["input_ids"]) for r in rows)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.long)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    # offline target features (data/features.py, data/regenerated.py): (T, D) per row; target_argmax (T,)
    for key in ("aux_hidden", "final_hidden", "target_argmax"):
        if key in rows[0]:
            batch[key] = torch.zeros((B, T) + tuple(rows[0][key].shape[1:]), dtype=rows[0][key].dtype)
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[b, :n] = torch.tensor(r["input_ids"])
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(r["loss_mask"])
        for key in ("aux_hidden", "final_hidden", "target_argmax"):
            if key in batch:
                batch[key][b, :n] = r[key]
    return batch
