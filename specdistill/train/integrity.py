"""Checkpoint integrity: every checkpoint records the size and SHA-256 of each of its files (manifest.json), resume
verifies the newest one before trusting it, and evaluation / export refuse a corrupt draft by name.

Knows nothing about training: it reads and writes files. A corrupt checkpoint is moved aside (renamed
step-N.corrupt, which no listing, pruning or cleanup touches), never deleted.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Callable, Optional

MANIFEST = "manifest.json"
CORRUPT_SUFFIX = ".corrupt"


class CorruptCheckpoint(ValueError):
    """A checkpoint or draft folder whose files do not match what was written; the message names each file."""


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


def move_aside(ckpt: Path, problems: list[str]) -> Path:
    """Rename a corrupt checkpoint to step-N.corrupt (never deleted; never listed, pruned or resumed from)."""
    dest = ckpt.with_name(ckpt.name + CORRUPT_SUFFIX)
    k = 1
    while dest.exists():
        k += 1
        dest = ckpt.with_name(f"{ckpt.name}{CORRUPT_SUFFIX}{k}")
    os.replace(ckpt, dest)
    (dest / "CORRUPT.txt").write_text("moved aside by resume; problems found:\n" + "\n".join(problems) + "\n")
    return dest


def select_resume(resume: Optional[str], output_dir, acc, log: Callable[[str], None] = print) -> Optional[Path]:
    """trainer.resume, verified. auto: the newest complete checkpoint whose files match its manifest; corrupt ones
    are moved aside by the main process (with a message naming the files) and the previous one is taken. A PATH
    that is corrupt is refused. Every rank must call this (one barrier)."""
    from specdistill.train.checkpoint import list_checkpoints, resolve_resume

    if not resume:
        return None
    if resume != "auto":
        p = resolve_resume(resume, output_dir)
        problems = verify_folder(p)
        if problems:
            raise CorruptCheckpoint(f"trainer.resume={resume!r} is corrupt:\n  - " + "\n  - ".join(problems)
                                    + "\nResume from an earlier checkpoint (or trainer.resume=auto).")
        return p
    moved = []
    if acc.is_main_process:
        for ck in reversed(list_checkpoints(output_dir)):
            problems = verify_folder(ck)
            if not problems:
                if not (ck / MANIFEST).exists():
                    log(f"[resume] {ck.name} has no {MANIFEST} (written before checksums): checked its safetensors "
                        "headers only")
                break
            dest = move_aside(ck, problems)
            moved.append(dest)
            log(f"[resume] {ck.name} is corrupt: " + "; ".join(problems) + f". Moved aside to {dest} (not deleted); "
                "falling back to the previous complete checkpoint")
    acc.wait_for_everyone()
    found = resolve_resume("auto", output_dir)
    if found is None and moved:
        raise CorruptCheckpoint(f"trainer.resume=auto: every checkpoint in {output_dir} is corrupt (moved aside: "
                                f"{[p.name for p in moved]}); nothing is left to resume from. Start fresh in another "
                                "trainer.output_dir, or repair a checkpoint by hand")
    return found
