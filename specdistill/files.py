"""File permissions for what other users and serving containers read (exports, checkpoints, cached models).

Knows nothing about models: it only fixes modes.
"""
from __future__ import annotations

import os
from pathlib import Path


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
