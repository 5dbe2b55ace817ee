"""Chat template rendering with an assistant-only loss mask, shifted together with the ids.

The mask is found from character spans, not from template markers, so it works for any chat template that
renders conversation prefixes as text prefixes (checked, with a clear error otherwise): the assistant span of turn
i runs from the end of render(messages[:i], add_generation_prompt=True) to the end of render(messages[:i+1]).
No `{% generation %}` markers are needed, so a user-supplied template (data.chat_template: a file or an inline Jinja
string, for base models without one or targets whose template lacks the markers) gets the same masks; it is checked
on a probe conversation when it is set (check_chat_template).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from specdistill.paths import resolve_chat_template

_PROBE = [{"role": "user", "content": "specdistill probe question"},
          {"role": "assistant", "content": "specdistill probe answer"}]


def set_chat_template(tokenizer, value: Optional[str]) -> None:
    """Install data.chat_template (a file or an inline template) on the tokenizer and check it renders usable masks.
    None keeps the tokenizer's own template."""
    if not value:
        return
    tokenizer.chat_template = resolve_chat_template(value)
    check_chat_template(tokenizer, what=f"data.chat_template={value[:60]!r}")


def check_chat_template(tokenizer, what: str = "the chat template") -> None:
    """Render a probe user/assistant conversation and raise a ValueError naming the fix when the template cannot give
    an assistant-only mask: it fails to render, never renders the assistant's text, rewrites earlier turns, or ignores
    add_generation_prompt while emitting an assistant header (the header would then be trained as answer text and
    generation prompts would end without it)."""
    try:
        text, spans = assistant_char_spans(tokenizer, _PROBE)
        bare = render(tokenizer, _PROBE[:1], add_generation_prompt=False)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    except Exception as e:  # jinja2 errors (syntax, undefined variables, raise_exception in the template)
        raise ValueError(f"{what} fails to render a user/assistant conversation ({type(e).__name__}: {e}): fix the "
                         "template (it receives `messages` with role/content and `add_generation_prompt`)") from None
    answer = _PROBE[1]["content"]
    start, end = spans[0]
    span = text[start:end]
    if answer not in span:
        raise ValueError(f"{what} never renders the assistant's text (rendered: {text[:200]!r}): the template must "
                         "output message['content'] for assistant turns")
    header = span[: span.index(answer)]
    if header.strip() and text[:start] == bare:
        raise ValueError(f"{what} ignores add_generation_prompt, so the assistant header {header!r} would be trained "
                         "as answer text and generation prompts would end without it: add "
                         f"`{{% if add_generation_prompt %}}{header}{{% endif %}}` at the end of the template")


@dataclass
class TokenizedConversation:
    input_ids: list[int]  # (T,)
    loss_mask: list[int]  # (T,) loss_mask[t] = 1 iff token t+1 is an assistant token (already shifted: predicts t+1)


def render(tokenizer, messages, add_generation_prompt: bool = False) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the target tokenizer has no chat template: set data.chat_template=<a .jinja file or an "
                         "inline Jinja template> (e.g. ChatML), or pick a chat/instruct target")
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
