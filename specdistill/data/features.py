"""Offline target features: aux hidden states and the target's final hidden state, written once, trained from.

Instead of the target's logits (V floats per token) we store its final normed hidden state (Ht floats) and rebuild
the logits with the target's lm_head at train time: ~V/Ht times less disk (85x for SmolLM2, 31x for Llama-3-8B).
Shards are safetensors files of concatenated tokens, cut at `shard_mb`, so the writer holds at most one shard in
memory; the reader memory-maps slices. manifest.json maps each example to (shard, start, length) and records each
shard's SHA-256, which the reader verifies (a shard damaged in place, even to the same size, is refused by name).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE = torch.bfloat16


def bytes_per_token(aux_dim: int, hidden: int) -> int:
    return (aux_dim + hidden) * torch.finfo(DTYPE).bits // 8


def estimate_bytes(num_tokens: int, aux_dim: int, hidden: int) -> int:
    return num_tokens * bytes_per_token(aux_dim, hidden)


class FeatureWriter:
    """Append examples; flushes a shard whenever `shard_mb` is reached. Writes into <out>.<host>-<pid>.tmp, renamed on
    close."""

    def __init__(self, out_dir, meta: dict, shard_mb: int = 256):
        self.final_dir = Path(out_dir)
        if self.final_dir.exists():
            raise FileExistsError(f"{self.final_dir} already exists: pick another data.offline_dir or delete it")
        # one temp folder per process: two writers never share one (the second rename then finds the folder made)
        self.dir = self.final_dir.with_name(f"{self.final_dir.name}.{socket.gethostname()}-{os.getpid()}.tmp")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.meta, self.limit = meta, shard_mb * 2**20
        self.index: list[list[int]] = []  # per example: [shard, start, length]
        self.aux: list[torch.Tensor] = []
        self.final: list[torch.Tensor] = []
        self.pending_tokens, self.shard = 0, 0

    def add(self, aux: torch.Tensor, final: torch.Tensor) -> None:
        """aux (T, A), final (T, Ht) of one example (padding already removed)."""
        self.index.append([self.shard, self.pending_tokens, aux.shape[0]])
        self.aux.append(aux.to(DTYPE).cpu())
        self.final.append(final.to(DTYPE).cpu())
        self.pending_tokens += aux.shape[0]
        if self.pending_tokens * bytes_per_token(aux.shape[1], final.shape[1]) >= self.limit:
            self._flush()

    def _flush(self) -> None:
        if not self.aux:
            return
        from safetensors.torch import save_file

        save_file({"aux": torch.cat(self.aux), "final": torch.cat(self.final)},
                  str(self.dir / f"shard-{self.shard:05d}.safetensors"))
        self.aux, self.final, self.pending_tokens = [], [], 0
        self.shard += 1

    def close(self) -> Path:
        from specdistill.files import sha256

        self._flush()
        sums = {f.name: sha256(f) for f in sorted(self.dir.glob("shard-*.safetensors"))}
        (self.dir / "manifest.json").write_text(json.dumps({"meta": self.meta, "index": self.index, "sha256": sums}))
        os.replace(self.dir, self.final_dir)
        return self.final_dir


@dataclass
class FeatureStore:
    """Read side: store[i] -> (aux (T, A), final (T, Ht)) for example i, memory-mapped."""
    root: Path

    def __post_init__(self):
        self.root = Path(self.root)
        man = self.root / "manifest.json"
        if not man.exists():
            raise FileNotFoundError(f"{self.root} is not a complete feature store (no manifest.json): run "
                                    "scripts/dump_features.py with the same data.offline_dir first")
        m = json.loads(man.read_text())
        self.meta, self.index = m["meta"], m["index"]
        self._handles = {}
        self.check_shards(m.get("sha256", {}))

    def check_shards(self, recorded: dict) -> None:
        """Every shard the manifest records must hold the bytes it was written with (ValueError naming each one that
        does not, and the fix); a manifest without checksums is not checked."""
        from specdistill.cache import file_digest

        bad = [f"{self.root / name}: " + ("missing" if not (self.root / name).exists() else
                                          "its SHA-256 differs from the one recorded in manifest.json")
               for name, digest in sorted(recorded.items())
               if not (self.root / name).exists() or file_digest(self.root / name) != digest]
        if bad:
            raise ValueError(f"the feature store {self.root} is damaged:\n  - " + "\n  - ".join(bad) + "\nRe-run "
                             "scripts/dump_features.py into a new data.offline_dir (or delete this one first)")

    def __len__(self) -> int:
        return len(self.index)

    def _open(self, shard: int):
        if shard not in self._handles:
            from safetensors import safe_open

            self._handles[shard] = safe_open(str(self.root / f"shard-{shard:05d}.safetensors"), framework="pt")
        return self._handles[shard]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard, start, n = self.index[i]
        f = self._open(shard)
        return f.get_slice("aux")[start:start + n], f.get_slice("final")[start:start + n]

    def check_matches(self, meta: dict) -> None:
        diff = {k: (self.meta.get(k), v) for k, v in meta.items() if self.meta.get(k) != v}
        if diff:
            raise ValueError(f"the features in {self.root} were written for another setup ({diff} as stored vs now): "
                             "re-run scripts/dump_features.py into a new data.offline_dir")


class WithFeatures:
    """A tokenized dataset whose rows also carry the stored target features (for the training loader)."""

    def __init__(self, dataset, store: FeatureStore):
        if len(dataset) != len(store):
            raise ValueError(f"feature store has {len(store)} examples, the training data {len(dataset)}: they were "
                             "made from different data; re-run scripts/dump_features.py")
        self.dataset, self.store = dataset, store

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        row = dict(self.dataset[i])
        row["aux_hidden"], row["final_hidden"] = self.store[i]
        return row
