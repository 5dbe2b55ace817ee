"""Training data on the target's own distribution: its answers to real prompts, with its features, in one decode.

EAGLE-3, SpecForge and speculators train heads on regenerated answers: a draft predicts the target's own text far
better than human or GPT-4 text. Here the regeneration also writes the EAGLE-3 training features (aux hidden states
and the final normed hidden state), captured from the very forwards that decode the answer
(decoding.target_generate(capture_layers=...)), so the target runs once per training token instead of once to
generate and once more per epoch. Rows are stored as generated token ids (no decode / re-tokenize round trip), so
ids and features are aligned by construction.

Layout of a store (one folder per setting; the folder name is a hash of everything the content depends on, except
how many prompts are answered: the bytes of the prompt source, the target's files (weights, config, tokenizer), its
dtype, the tokenizer as it encodes with its chat template, the generation settings and the captured layers):
  settings.json           what the content depends on (and whether answers are greedy), written at creation
  part-NNNNN.safetensors  decode batch N = prompts [N*batch_size, (N+1)*batch_size) of the filtered source: ids (N,)
                          int64, aux (N, A) bf16, final (N, H) bf16, lengths (n,), prompt_lengths (n,); written to a
                          temp name of its own process and renamed, so a part is whole or absent even when several
                          processes write into one store
  part-NNNNN.sha256       the part's SHA-256, written before the part is renamed into place: a part whose bytes differ
                          (damaged in place, even to the same size) is named and made again (drop_damaged_parts)
A part's content depends only on the settings and its index, so a run asking for more prompts reuses every part an
earlier run wrote and decodes only the rest; an interrupted run resumes at the first missing part; a changed setting
hashes to another folder, and so does an edited prompt file or new weights in the same target folder. Other captured
layers (target.aux_layer_ids) are another folder too, but of the same answers:
pipeline/regenerate.py fills it by one prefill of the stored ids per part instead of decoding again.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

FEATURE_DTYPE = torch.bfloat16
FORMAT_VERSION = 1


def store_settings(cfg) -> dict:
    """The settings a part's content depends on (not how many parts a run reads, not where the store lives, not which
    engine or shard wrote it: every engine writes the target's answers with their features)."""
    ignored = ("enabled", "store_dir", "max_prompts", "engine", "engine_args", "shard")
    return {k: v for k, v in asdict(cfg).items() if k not in ignored}


def num_parts(cfg) -> int:
    """Parts a run with cfg reads: max_prompts rounded up to whole decode batches."""
    return -(-cfg.max_prompts // cfg.batch_size)


def part_path(root: Path, i: int) -> Path:
    return Path(root) / f"part-{i:05d}.safetensors"


def store_inputs(cfg, target_path: str, target_dtype, capture_layers: list[int], tokenizer) -> dict:
    """Everything a store's content depends on, by content: settings.json records it, store_key hashes it.

    cfg has a resolved batch_size (it fixes which prompts share a part). Digests are of bytes (specdistill.cache), so
    a prompt file edited in place or new weights in the same target folder give other inputs; a target or prompt
    source that is not on disk (a hub id) is known by its name only."""
    from specdistill.assets import model_digest, source_digest
    from specdistill.cache import tokenizer_digest

    return {"settings": store_settings(cfg), "layers": list(capture_layers), "target": str(target_path),
            "target_files": model_digest(str(target_path)), "target_dtype": str(target_dtype).removeprefix("torch."),
            "prompts_bytes": source_digest(cfg.prompts), "tokenizer": tokenizer_digest(tokenizer),
            "chat_template": getattr(tokenizer, "chat_template", None), "v": FORMAT_VERSION}


def store_key(inputs: dict) -> str:
    """The store's folder name: a hash of store_inputs (any changed input misses)."""
    key = {k: v for k, v in inputs.items() if k != "target"}  # by content: the same files under another path hit
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def input_differences(recorded: dict, wanted: dict) -> list[str]:
    """Human-readable differences between two store_inputs (settings compared key by key), e.g.
    ["max_new_tokens: 12 (stored) vs 6 (now)", "target_files: sha256:ab.. vs sha256:cd.."]."""
    def flat(d: dict) -> dict:
        out = {k: v for k, v in d.items() if k != "settings"}
        out.update(d.get("settings", {}))
        return out

    a, b = flat(recorded), flat(wanted)
    return [f"{k}: {a.get(k)!r} (stored) vs {b.get(k)!r} (now)" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


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


def checksum_path(part: Path) -> Path:
    """Where a part's SHA-256 is recorded: part-NNNNN.sha256 beside part-NNNNN.safetensors."""
    return Path(part).with_suffix(".sha256")


def part_problem(part: Path) -> Optional[str]:
    """Why a stored part cannot be used (its safetensors header or size, or bytes that differ from the SHA-256 recorded
    when it was written), or None. A part written without a record is checked by its header only."""
    from specdistill.cache import file_digest
    from specdistill.files import safetensors_problem

    why = safetensors_problem(part)
    if why:
        return why
    try:
        recorded = checksum_path(part).read_text().strip()
    except OSError:
        return None
    if recorded and file_digest(part) != recorded:
        return f"its SHA-256 differs from the one recorded in {checksum_path(part).name} when it was written"
    return None


def drop_damaged_parts(root: Path, log=print) -> list[Path]:
    """Delete (with their checksum records) the parts of a store that part_problem finds damaged, naming each and why;
    the regeneration then makes them again. Returns the deleted parts."""
    dropped = []
    for part in sorted(Path(root).glob("part-*.safetensors")):
        why = part_problem(part)
        if why:
            log(f"[regenerate] {part} is damaged ({why}): a store part is a cache, so it is deleted and made again")
            part.unlink(missing_ok=True)
            checksum_path(part).unlink(missing_ok=True)
            dropped.append(part)
    return dropped


def write_part(path: Path, rows: list[dict]) -> None:
    from safetensors.torch import save_file

    from specdistill.files import sha256

    tmp = path.with_name(f"{path.name}.{socket.gethostname()}-{os.getpid()}.tmp")  # one temp name per process
    save_file({"ids": torch.cat([r["ids"] for r in rows]),
               "aux": torch.cat([r["aux"] for r in rows]).to(FEATURE_DTYPE).contiguous(),
               "final": torch.cat([r["final"] for r in rows]).to(FEATURE_DTYPE).contiguous(),
               "lengths": torch.tensor([len(r["ids"]) for r in rows], dtype=torch.long),
               "prompt_lengths": torch.tensor([r["prompt_length"] for r in rows], dtype=torch.long)}, str(tmp))
    record = checksum_path(path)
    record_tmp = record.with_name(f"{record.name}.{socket.gethostname()}-{os.getpid()}.tmp")
    record_tmp.write_text(sha256(tmp) + "\n")
    os.replace(record_tmp, record)  # the record first: a part in place always has its own
    os.replace(tmp, path)


class RegeneratedStore:
    """Read side: store[i] -> {input_ids, loss_mask, aux_hidden (T, A), final_hidden (T, H)}; store["input_ids"]
    and store["loss_mask"] give whole columns (what frequent_token_vocab reads). Parts are memory-mapped."""

    def __init__(self, root, parts: int, rows: Optional[list[int]] = None):
        from safetensors import safe_open

        self.root = Path(root)
        self._parts, index = [], []
        missing = [i for i in range(parts) if not part_path(self.root, i).exists()]
        if missing:
            raise FileNotFoundError(f"regenerated store {self.root} lacks parts {missing[:5]} of {parts}: run the "
                                    "regeneration again with the same settings (it resumes where it stopped)")
        for k, f in enumerate(part_path(self.root, i) for i in range(parts)):
            h = safe_open(str(f), framework="pt")
            self._parts.append(h)
            lengths, plens = h.get_tensor("lengths").tolist(), h.get_tensor("prompt_lengths").tolist()
            start = 0
            for n, p in zip(lengths, plens):
                index.append((k, start, n, p))
                start += n
        self._index = index if rows is None else [index[i] for i in rows]
        settings = json.loads((self.root / "settings.json").read_text())
        # Greedy answers: the target's argmax at an answer position is the token it emitted there, exactly (the
        # features are from the very forward that chose it), so rows carry it and training never rebuilds full logits.
        self.greedy = settings["settings"]["temperature"] == 0

    def report(self) -> dict:
        return {"rows": len(self), "answer_tokens": self.answer_tokens, "tokens": self.total_tokens,
                "parts": len(self._parts), "bytes": sum(part_path(self.root, i).stat().st_size
                                                        for i in range(len(self._parts)))}

    def subset(self, rows: list[int]) -> "RegeneratedStore":
        out = RegeneratedStore.__new__(RegeneratedStore)
        out.root, out._parts, out.greedy = self.root, self._parts, self.greedy
        out._index = [self._index[i] for i in rows]
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
        ids = h.get_slice("ids")[s: s + n]  # (T,)
        row = {"input_ids": ids.tolist(), "loss_mask": loss_mask_for(n, p),
               "aux_hidden": h.get_slice("aux")[s: s + n], "final_hidden": h.get_slice("final")[s: s + n]}
        if self.greedy:
            row["target_argmax"] = torch.cat([ids[1:], ids[-1:]])  # (T,) argmax at t = token t+1 (answer positions)
        return row

    column_names = ("input_ids", "loss_mask")


