"""Prompt batches the evaluator decodes: consecutive prompts left-padded together, prompt order kept."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.tensors import pad_rows


@dataclass
class PromptBatch:
    input_ids: torch.Tensor       # (B, T) left-padded
    attention_mask: torch.Tensor  # (B, T)
    index: list[int]              # prompt indices


def make_batches(prompt_ids: list[list[int]], batch_size: int, pad_id: int, device) -> list[PromptBatch]:
    """Left-pad consecutive prompts into batches (order kept: results are per prompt)."""
    out = []
    for s in range(0, len(prompt_ids), batch_size):
        rows = prompt_ids[s:s + batch_size]
        ids, mask = pad_rows(rows, pad_id, side="left")
        out.append(PromptBatch(ids.to(device), mask.to(device), list(range(s, s + len(rows)))))
    return out
