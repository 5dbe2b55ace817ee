"""Resuming from a verified checkpoint: the newest one is checked against its manifest (files.verify_folder); a
corrupt one is moved aside (renamed step-N.corrupt, which no listing, pruning or cleanup touches), never deleted,
and the previous complete one is used.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from specdistill.files import MANIFEST, CorruptCheckpoint, verify_folder

CORRUPT_SUFFIX = ".corrupt"


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
                    log(f"[resume] {ck.name} has no {MANIFEST} (no checksums to compare): checked its safetensors "
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
