"""Files other users and engines read: modes that follow the umask (exports, checkpoints, cached models), and
integrity records (size and SHA-256 of every written file, manifest.json) that resume, evaluation and export verify.

Knows nothing about models or training: it reads, hashes and fixes modes of files.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"


class CorruptCheckpoint(ValueError):
    """A checkpoint or draft folder whose files do not match what was written; the message names each file."""


def follow_umask(path: Path) -> None:
    """Give a folder tree the permissions the umask asks for (0755 / 0644 under umask 022): tempfile.mkdtemp makes
    0700 folders, which another user or a serving container cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    path = Path(path)
    for p in [path, *path.rglob("*")]:
        if p.is_symlink():
            continue
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


# ---------------------------------------------------------------- integrity: sizes and SHA-256 of written files
def sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> dict:
    """Record {relative path: {size, sha256}} of every file under `folder` in folder/manifest.json."""
    folder = Path(folder)
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256(p)} for p in _files(folder)}
    manifest = {"version": 1, "files": files}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)
    return manifest


def safetensors_problem(path: Path) -> Optional[str]:
    """Why a .safetensors file cannot be read (truncated, bad header), or None. Reads only the header."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"truncated: {size} bytes, shorter than the 8-byte safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"truncated: header says {n} bytes of metadata, the file has {size} bytes"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"unreadable safetensors header ({type(e).__name__}: {e})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        return f"truncated: tensors need {8 + n + end} bytes, the file has {size}"
    return None


def verify_folder(folder: Path, only: str = "") -> list[str]:
    """Problems of `folder` (or of its sub-folder `only`, e.g. "draft/"), one line per file; [] when sound.
    With a manifest: every recorded file must exist with its size and checksum. Always: every .safetensors file
    must hold the tensors its header promises (which catches truncation in folders written before manifests)."""
    folder = Path(folder)
    problems = []
    mf = folder / MANIFEST
    if mf.exists():
        try:
            files = json.loads(mf.read_text())["files"]
        except (OSError, ValueError, KeyError) as e:
            return [f"{mf}: unreadable manifest ({type(e).__name__})"]
        for rel, meta in files.items():
            if not rel.startswith(only):
                continue
            p = folder / rel
            if not p.exists():
                problems.append(f"{p}: missing (recorded in {MANIFEST})")
            elif p.stat().st_size != meta["size"]:
                problems.append(f"{p}: {p.stat().st_size} bytes, {meta['size']} were written (truncated or replaced)")
            elif sha256(p) != meta["sha256"]:
                problems.append(f"{p}: checksum differs from the one recorded when it was written (corrupted)")
    checked = {line.split(":")[0] for line in problems}
    for p in sorted((folder / only).rglob("*.safetensors")) if (folder / only).exists() else []:
        why = safetensors_problem(p) if str(p) not in checked else None
        if why:
            problems.append(f"{p}: {why}")
    return problems


def check_draft_folder(draft_dir, what: str = "draft") -> None:
    """Raise CorruptCheckpoint naming each bad file of a draft folder (a checkpoint's draft/, or an export).
    Uses the folder's own manifest, or its checkpoint's (the parent's, for .../step-N/draft)."""
    d = Path(draft_dir).expanduser()
    if not d.exists():
        return  # the loaders say what is missing
    if (d / MANIFEST).exists():
        problems = verify_folder(d)
    elif (d.parent / MANIFEST).exists():
        problems = verify_folder(d.parent, only=d.name + "/")
    else:
        problems = verify_folder(d)
    if problems:
        raise CorruptCheckpoint(f"the {what} at {d} is corrupt; refusing to use it:\n  - " + "\n  - ".join(problems)
                                + "\nUse an earlier checkpoint's draft/ folder, or retrain.")
