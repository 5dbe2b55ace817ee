"""Regeneration telemetry: the store's size before it is written, and how long answering and feature capture took.

It knows nothing about engines or decoding: pipeline/regenerate.py times each part and hands the numbers here.
A store folder holds, beside its parts:
  timing/part-NNNNN.json  one record per written part (PartTiming): who wrote it, its tokens, answer and recapture
                          seconds; written whole (temp name + rename), so shards on many machines never clash
  timing.json             the sum over those records (StageTiming, per engine), rewritten after each run's parts
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ID_BYTES = 8  # a stored token id is int64


@dataclass(frozen=True)
class StoreSize:
    """An upper bound on what a store's parts take: every answer at max_new_tokens."""
    parts: int
    rows: int
    tokens: int  # prompt tokens + rows x max_new_tokens
    bytes_per_token: int  # the id plus the features of every captured layer
    bytes: int


def estimate_store_size(prompt_lengths: list[int], parts: int, max_new_tokens: int, feature_width: int,
                        feature_bytes: int) -> StoreSize:
    """The size of `parts` parts holding rows of these prompts (lengths in tokens) and answers of at most
    max_new_tokens, each token stored as its id and `feature_width` features of `feature_bytes` bytes."""
    tokens = sum(prompt_lengths) + len(prompt_lengths) * max_new_tokens
    per_token = ID_BYTES + feature_width * feature_bytes
    return StoreSize(parts, len(prompt_lengths), tokens, per_token, tokens * per_token)


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk of `folder` (or of its nearest existing parent)."""
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def size_text(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_free_space(size: StoreSize, folder: Path, free: int, max_prompts: int, max_new_tokens: int) -> None:
    """Refuse, before any part is written, a store whose upper bound exceeds the free space, naming what to lower."""
    if size.bytes <= free:
        return
    from specdistill.files import WriteFailed

    raise WriteFailed(errno.ENOSPC, f"the regenerated store's {size.parts} missing parts take up to "
                                    f"{size_text(size.bytes)} ({size.rows} rows x <= {max_new_tokens} new tokens, "
                                    f"{size.bytes_per_token} bytes a token) and {folder} has {size_text(free)} free. "
                                    f"Lower data.regenerate.max_prompts ({max_prompts}) or "
                                    f"data.regenerate.max_new_tokens ({max_new_tokens}), or move the store with "
                                    "data.regenerate.store_dir=<a larger disk>")


@dataclass(frozen=True)
class PartTiming:
    """How one part was written. answer_s: producing its answers (engine=hf decodes and captures the features in the
    same forwards, so its features cost nothing extra: recapture_s 0); recapture_s: the prefill that gives an engine's
    (or a donor store's) answers their features."""
    part: int
    engine: str  # hf | vllm | HFEngine ... | donor (answers of a store with other layers)
    rows: int
    prompt_tokens: int
    answer_tokens: int
    answer_s: float
    recapture_s: float
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)

    @property
    def answer_tok_s(self) -> float:
        return self.answer_tokens / self.answer_s if self.answer_s > 0 else 0.0

    @property
    def recapture_tok_s(self) -> float:
        tokens = self.prompt_tokens + self.answer_tokens
        return tokens / self.recapture_s if self.recapture_s > 0 else 0.0

    def line(self) -> str:
        """One human-readable line, e.g. 'part 3 (vllm): 16 rows, 2410 answer tokens in 9.1 s (265 tok/s); features of
        5890 tokens in 3.0 s (1963 tok/s)'."""
        out = f"part {self.part} ({self.engine}): {self.rows} rows"
        if self.answer_s > 0:
            out += f", {self.answer_tokens} answer tokens in {self.answer_s:.1f} s ({self.answer_tok_s:.0f} tok/s)"
        if self.recapture_s > 0:
            out += (f"; features of {self.prompt_tokens + self.answer_tokens} tokens in {self.recapture_s:.1f} s "
                    f"({self.recapture_tok_s:.0f} tok/s)")
        return out


def timing_path(root: Path, part: int) -> Path:
    return Path(root) / "timing" / f"part-{part:05d}.json"


def record_part(root: Path, t: PartTiming) -> None:
    """Write the part's record whole (a reader sees it or not; shards on other machines write other names)."""
    from specdistill.files import write_text_atomic

    path = timing_path(root, t.part)
    path.parent.mkdir(exist_ok=True)
    write_text_atomic(path, json.dumps(asdict(t), indent=1))


def read_parts(root: Path, parts: Optional[int] = None) -> list[PartTiming]:
    """The records of the parts written so far (those below `parts` when given), in part order."""
    out = []
    for f in sorted((Path(root) / "timing").glob("part-*.json")):
        try:
            t = PartTiming(**json.loads(f.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # a record from another version or a torn copy is left out of the sums
        if parts is None or t.part < parts:
            out.append(t)
    return out


def stage_timing(records: list[PartTiming]) -> dict:
    """Per engine: parts, rows, tokens, answer and recapture seconds and tokens/s, and the sum of the two stages.
    Seconds are summed over parts, so with n shards in parallel the wall time is about their sum / n."""
    by: dict = {}
    for t in records:
        e = by.setdefault(t.engine, {"parts": 0, "rows": 0, "prompt_tokens": 0, "answer_tokens": 0, "answer_s": 0.0,
                                     "recapture_s": 0.0})
        e["parts"] += 1
        e["rows"] += t.rows
        e["prompt_tokens"] += t.prompt_tokens
        e["answer_tokens"] += t.answer_tokens
        e["answer_s"] += t.answer_s
        e["recapture_s"] += t.recapture_s
    for e in by.values():
        a, r = e["answer_s"], e["recapture_s"]
        tokens = e["prompt_tokens"] + e["answer_tokens"]
        e.update(answer_s=round(a, 4), recapture_s=round(r, 4), total_s=round(a + r, 4),
                 answer_tok_s=round(e["answer_tokens"] / a, 1) if a > 0 else None,
                 recapture_tok_s=round(tokens / r, 1) if r > 0 else None,
                 answer_tok_s_overall=round(e["answer_tokens"] / (a + r), 1) if a + r > 0 else None)
    return by


def write_summary(root: Path, parts: Optional[int] = None) -> dict:
    """timing.json of the store: stage_timing over the records of its parts (every writer's, every shard's);
    returns it. A store written before records existed has an empty summary."""
    from specdistill.files import write_text_atomic

    summary = {"stages": stage_timing(read_parts(root, parts)),
               "note": "answer_s: writing the answers (engine=hf captures the features while decoding); recapture_s: "
                       "one prefill per part giving an engine's answers their features; seconds summed over parts"}
    write_text_atomic(Path(root) / "timing.json", json.dumps(summary, indent=1))
    return summary
