"""Tensor helpers every layer shares: padding token rows into a batch, shifting along time, unwrapping a module."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

Row = Union[torch.Tensor, Sequence[int]]


def pad_rows(rows: Sequence[Row], pad_id: int, side: str = "left", device: Optional[torch.device] = None,
             length: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """R token rows of lengths L_r -> ids (R, L) and attention mask (R, L), L = max(length, max L_r), padded on `side`.

    Rows are 1-D long tensors or lists of ints; the batch is made on `device` (default: the first tensor row's
    device, else the CPU). Example: rows [[5, 6], [7]], pad 0, left -> ids [[5, 6], [0, 7]], mask [[1, 1], [0, 1]].
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if device is None:
        device = rows[0].device if isinstance(rows[0], torch.Tensor) else torch.device("cpu")
    L = max(length, max(len(r) for r in rows))
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), L), dtype=torch.long, device=device)
    for k, r in enumerate(rows):
        n = len(r)
        cols = slice(L - n, L) if side == "left" else slice(0, n)
        ids[k, cols] = r if isinstance(r, torch.Tensor) else torch.tensor(r, dtype=torch.long)
        mask[k, cols] = 1
    return ids, mask


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids of a (B, T) attention mask: 0 at each row's first real token (left padding gets 0)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x (B, T, ...) -> y with y[:, t] = x[:, t + n] and `fill` past the end."""
    if n == 0:
        return x
    y = torch.full_like(x, fill)
    y[:, :-n] = x[:, n:]
    return y


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DDP / FSDP / accelerate wrapper (`.module`), or the model itself."""
    return getattr(model, "module", model)


def unwrap_target(target: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a target wrapper (specdistill.models.target.Target keeps it in `.model`), or the model."""
    return getattr(target, "model", target)


# Row blocks of full-vocabulary work, in values per block: 128 MiB of fp32 on a GPU (few kernel launches); 4 MiB on a
# CPU, where each block's temporaries are new allocations and blocks past glibc's mmap threshold are handed fresh pages
# every time (page faults made a 128 MiB block 4x slower per value than 4 MiB ones on 2 cores).
ROW_BLOCK_ELEMENTS = {"cpu": 1 << 20}
DEFAULT_ROW_BLOCK_ELEMENTS = 1 << 25


def block_rows(width: int, device: torch.device, max_elements: Optional[int] = None) -> int:
    """Rows of `width` values per block on `device` (max_elements None: ROW_BLOCK_ELEMENTS of its type), at least 1."""
    if max_elements is None:
        max_elements = ROW_BLOCK_ELEMENTS.get(device.type, DEFAULT_ROW_BLOCK_ELEMENTS)
    return max(1, max_elements // max(width, 1))
