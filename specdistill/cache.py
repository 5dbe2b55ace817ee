"""Where specdistill caches what it builds, and content digests for cache keys: a changed byte is another key.

A file's SHA-256 is computed once and remembered under CACHE_ROOT/digests, keyed by the file's resolved path, inode,
size and modification and change times (ns): a file rewritten or replaced in place is hashed again, an untouched one
is only stat-ed. This module knows nothing about what the digests key (models, data, stores: specdistill.assets and
the callers).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

CACHE_ROOT = Path(os.environ.get("SPECDISTILL_CACHE", "~/.cache/specdistill")).expanduser()

_memo: dict[str, str] = {}


def _stat_key(p: Path) -> str:
    st = p.stat()
    return f"{p.resolve()}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _remember(record: Path, digest: str) -> None:
    """Best effort: a read-only cache only costs hashing again next time."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=record.name + ".", dir=record.parent)  # one temp name per writer
        with os.fdopen(fd, "w") as f:
            f.write(digest)
        os.replace(tmp, record)
    except OSError:
        pass


def file_digest(path) -> str:
    """SHA-256 (hex) of a file's bytes, remembered by path, inode, size and times."""
    p = Path(path).expanduser()
    key = _stat_key(p)
    if key in _memo:
        return _memo[key]
    record = CACHE_ROOT / "digests" / hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        digest = record.read_text().strip()
    except OSError:
        digest = ""
    if len(digest) != 64:
        h = hashlib.sha256()
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        digest = h.hexdigest()
        _remember(record, digest)
    _memo[key] = digest
    return digest


def folder_digest(folder) -> str:
    """One digest over the files of a folder, recursively (hidden and *.tmp files left out): names and bytes."""
    root = Path(folder).expanduser()
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or f.name.endswith(".tmp"):
            continue
        h.update(f"{rel.as_posix()}\0{file_digest(f)}\n".encode())
    return h.hexdigest()


def path_digest(path) -> Optional[str]:
    """A file's or a folder's content digest, or None when nothing is at `path`."""
    p = Path(str(path)).expanduser()
    if p.is_file():
        return "sha256:" + file_digest(p)
    if p.is_dir():
        return "sha256:" + folder_digest(p)
    return None


def tokenizer_digest(tokenizer) -> str:
    """The tokenizer as it encodes: its vocabulary (added tokens included), special tokens and chat template."""
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    blob = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()), "special": special,
                       "template": getattr(tokenizer, "chat_template", None), "class": type(tokenizer).__name__},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
