"""Training data on the target's own distribution: its answers to real prompts, with its features, in one decode.

EAGLE-3, SpecForge and speculators train heads on regenerated answers: a draft predicts the target's own text far
better than human or GPT-4 text. Here the regeneration also writes the EAGLE-3 training features (aux hidden states
and the final normed hidden state), captured from the very forwards that decode the answer
(spec.generate.target_generate(capture_layers=...)), so the target runs once per training token instead of once to
generate and once more per epoch. Rows are stored as generated token ids (no decode / re-tokenize round trip), so
ids and features are aligned by construction.

Layout of a store (one folder per setting; the folder name is a hash of everything the content depends on):
  part-NNNNN.safetensors  one decode batch: ids (N,) int64, aux (N, A) bf16, final (N, H) bf16, lengths (n,),
                          prompt_lengths (n,); written to a temp name and renamed, so a part is whole or absent
  complete.json           the settings and the report, written last: its presence means the store is reusable
An interrupted run resumes at the first missing part; a changed setting hashes to another folder.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

FEATURE_DTYPE = torch.bfloat16
FORMAT_VERSION = 1


def store_key(cfg, target_path: str, capture_layers: list[int], tokenizer) -> str:
    """What the store's content depends on; the cache folder is named after it (a changed setting misses)."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("enabled", "store_dir")}
    key = {"target": str(target_path), "layers": list(capture_layers), "settings": settings,
           "template": getattr(tokenizer, "chat_template", None), "vocab": len(tokenizer), "v": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def split_rows(prompts: list[list[int]], sequences: torch.Tensor, num_new: torch.Tensor, hidden: torch.Tensor,
               aux_width: int) -> list[dict]:
    """One decode batch -> rows {ids (T,), aux (T, A), final (T, H), prompt_length}.

    prompts: each row's prompt ids (the batch was left-padded to P = the longest); sequences (B, N) generated ids;
    num_new (B,); hidden (B, P-1+steps, A+H): column c = features of token c of [left-padded prompt, generated].
    The last token of a row was never fed to the target: its features are zeros; nothing reads them (a slot's
    features only predict tokens after it, and the last slot predicts nothing inside the row).
    """
    P = max(len(p) for p in prompts)
    rows = []
    for b, p in enumerate(prompts):
        n = int(num_new[b])
        ids = torch.tensor(list(p) + sequences[b, :n].tolist(), dtype=torch.long)  # (T,)
        start = P - len(p)  # first real column of this row
        feats = hidden[b, start: start + len(ids)]  # (<= T, A+H)
        if feats.shape[0] < len(ids):
            feats = torch.cat([feats, feats.new_zeros(len(ids) - feats.shape[0], feats.shape[1])])
        rows.append({"ids": ids, "aux": feats[:, :aux_width], "final": feats[:, aux_width:], "prompt_length": len(p)})
    return rows


def loss_mask_for(length: int, prompt_length: int) -> list[int]:
    """loss_mask[t] = 1 iff token t+1 is a generated (answer) token (the dataset convention: shifted with the ids)."""
    return [1 if prompt_length - 1 <= t < length - 1 else 0 for t in range(length)]


def _write_part(path: Path, rows: list[dict]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({"ids": torch.cat([r["ids"] for r in rows]),
               "aux": torch.cat([r["aux"] for r in rows]).to(FEATURE_DTYPE).contiguous(),
               "final": torch.cat([r["final"] for r in rows]).to(FEATURE_DTYPE).contiguous(),
               "lengths": torch.tensor([len(r["ids"]) for r in rows], dtype=torch.long),
               "prompt_lengths": torch.tensor([r["prompt_length"] for r in rows], dtype=torch.long)}, str(tmp))
    os.replace(tmp, path)


class RegeneratedStore:
    """Read side: store[i] -> {input_ids, loss_mask, aux_hidden (T, A), final_hidden (T, H)}; store["input_ids"]
    and store["loss_mask"] give whole columns (what frequent_token_vocab reads). Parts are memory-mapped."""

    def __init__(self, root, rows: Optional[list[int]] = None):
        from safetensors import safe_open

        self.root = Path(root)
        self._parts, index = [], []
        for k, f in enumerate(sorted(self.root.glob("part-*.safetensors"))):
            h = safe_open(str(f), framework="pt")
            self._parts.append(h)
            lengths, plens = h.get_tensor("lengths").tolist(), h.get_tensor("prompt_lengths").tolist()
            start = 0
            for n, p in zip(lengths, plens):
                index.append((k, start, n, p))
                start += n
        self._index = index if rows is None else [index[i] for i in rows]

    def subset(self, rows: list[int]) -> "RegeneratedStore":
        out = RegeneratedStore.__new__(RegeneratedStore)
        out.root, out._parts, out._index = self.root, self._parts, [self._index[i] for i in rows]
        return out

    def __len__(self) -> int:
        return len(self._index)

    @property
    def answer_tokens(self) -> int:
        return sum(n - p for _, _, n, p in self._index)

    @property
    def total_tokens(self) -> int:
        return sum(n for _, _, n, _ in self._index)

    def _ids(self, i: int) -> list[int]:
        k, s, n, _ = self._index[i]
        return self._parts[k].get_slice("ids")[s: s + n].tolist()

    def __getitem__(self, i):
        if isinstance(i, str):
            if i == "input_ids":
                return [self._ids(j) for j in range(len(self))]
            if i == "loss_mask":
                return [loss_mask_for(n, p) for _, _, n, p in self._index]
            raise KeyError(i)
        k, s, n, p = self._index[i]
        h = self._parts[k]
        return {"input_ids": h.get_slice("ids")[s: s + n].tolist(), "loss_mask": loss_mask_for(n, p),
                "aux_hidden": h.get_slice("aux")[s: s + n], "final_hidden": h.get_slice("final")[s: s + n]}

    column_names = ("input_ids", "loss_mask")


