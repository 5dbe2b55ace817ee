"""Files other users and engines read: modes that follow the umask (exports, checkpoints, cached models), integrity
records (size and SHA-256 of every written file, manifest.json) that resume, evaluation and export verify, one
writer per folder (folder_lock), and disk faults that name the folder and the setting that moves it.

Knows nothing about models or training: it reads, hashes, locks and fixes modes of files.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import struct
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

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


def drop_damaged(files, what: str, log: Callable[[str], None] = print) -> list[Path]:
    """Delete each of `files` (cache files in safetensors format) whose header or size says it is damaged, naming it
    and why; the caller rebuilds what is missing. Returns the deleted paths."""
    dropped = []
    for f in map(Path, files):
        why = safetensors_problem(f) if f.exists() else None
        if why:
            log(f"[cache] {f} is damaged ({why}): the {what} is a cache, so it is deleted and made again")
            f.unlink(missing_ok=True)
            dropped.append(f)
    return dropped


def verify_folder(folder: Path, only: str = "") -> list[str]:
    """Problems of `folder` (or of its sub-folder `only`, e.g. "draft/"), one line per file; [] when sound.
    With a manifest: every recorded file must exist with its size and checksum. Always: every .safetensors file
    must hold the tensors its header promises (which catches truncation in a folder without a manifest)."""
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


# ---------------------------------------------------------------- atomic small files
def write_text_atomic(path: Path, text: str) -> None:
    """Write `path` under a temporary name and rename it into place: a reader sees the old file or the new one,
    never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# ---------------------------------------------------------------- one writer per folder
LOCK_FILE = ".specdistill.lock"


@contextmanager
def replace_folder(out_dir, overwrite: bool = True) -> Iterator[Path]:
    """Write a folder atomically: yields a temporary folder beside `out_dir` to fill; when the block ends without an
    error it takes the umask's permissions and replaces `out_dir` in one rename (an existing one is replaced only
    with overwrite=True), so a half-written folder is never taken for a finished one. The temporary folder is removed
    on any error."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield tmp
        follow_umask(tmp)  # mkdtemp made it 0700: these folders are read by other users and serving containers
        if out_dir.exists():
            if not overwrite:
                raise FileExistsError(f"{out_dir} appeared while it was being written; not replacing it")
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class FolderBusy(RuntimeError):
    """Another live process holds a folder's lock; the message names it (pid, host, command)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _read_holder(lock: Path) -> Optional[dict]:
    try:
        return json.loads(lock.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: treated as held (never taken over on a guess)


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('started', '?')} "
            f"({holder.get('command', '?')})")


def _process_start(pid: int) -> Optional[float]:
    """When process `pid` of this host started (Unix time, from /proc), or None where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _reused_pid(holder: dict) -> bool:
    """The holder's pid runs, but as a process that started after the lock was taken: the pid was reused by an
    unrelated process and the run that took the lock is gone."""
    try:
        taken = time.mktime(time.strptime(str(holder.get("started")), "%Y-%m-%dT%H:%M:%S%z"))
    except ValueError:
        return False
    started = _process_start(int(holder["pid"]))
    return started is not None and started > taken + 2  # whole seconds in the lock, tick rounding in /proc


def _create_whole(src: Path, dst: Path) -> None:
    """Create `dst` with `src`'s content, or raise FileExistsError: a hard link where the file system has them (the
    content appears at once), else an exclusive create followed by the write."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError:  # no hard links here (some network and FUSE file systems)
        fd = os.open(dst, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(src.read_text())


@contextmanager
def folder_lock(folder, setting: str, log: Callable[[str], None] = print) -> Iterator[Path]:
    """Hold `folder`/.specdistill.lock (pid, host, start time, command line) while this process writes into the
    folder. A second writer is refused (FolderBusy naming the holder and `setting`, the key that picks another
    folder). A lock whose holder is dead (a pid that no longer runs on this host) is taken over with a message. The
    same process may nest the lock (the inner one is a no-op). The lock file is created whole (written under a
    temporary name, then hard-linked into place), so a reader never sees a half-written holder."""
    folder = check_writable(folder, setting)  # a read-only or full folder is named before the lock is written
    lock = folder / LOCK_FILE
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)[:300]}
    tmp = folder / f"{LOCK_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(me))
    owned = False
    try:
        for _ in range(3):  # a race with another taker: retry a few times, then report the holder
            try:
                _create_whole(tmp, lock)
                owned = True
                break
            except FileExistsError:
                holder = _read_holder(lock)
                if holder is None:
                    continue  # released meanwhile
                if holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
                    break  # this process holds it already: nested
                if not holder:
                    raise FolderBusy(
                        f"{lock} is unreadable (empty or not the JSON a run writes), so no holder can be named and it "
                        f"is not taken over on a guess. If no run writes into {folder}, delete {lock}; or write "
                        f"elsewhere with {setting}=<another folder>") from None
                stale = holder.get("host") == me["host"] and isinstance(holder.get("pid"), int) and (
                    not _pid_alive(holder["pid"]) or _reused_pid(holder))
                if not stale:
                    raise FolderBusy(
                        f"{folder} is in use by another run: {_describe(holder)} holds {lock}. Wait for it to end, "
                        f"or write elsewhere with {setting}=<another folder>. If that process is gone (another "
                        f"host's, or killed), delete {lock}") from None
                gone = ("now belongs to a process started after the lock was taken" if _pid_alive(holder["pid"])
                        else "is no longer running")
                log(f"[lock] {lock} was held by {_describe(holder)}, whose pid {gone}: taking it over")
                stale_copy = folder / f"{LOCK_FILE}.{os.getpid()}.stale"
                try:
                    os.replace(lock, stale_copy)  # a rename: of two takers, one moves it and both retry the link
                except FileNotFoundError:
                    continue
                if (_read_holder(stale_copy) or {}).get("pid") != holder.get("pid"):
                    os.replace(stale_copy, lock)  # another taker's fresh lock moved by mistake: put it back
                stale_copy.unlink(missing_ok=True)
        else:
            raise FolderBusy(f"{folder}: could not take {lock} (other processes keep taking it); set {setting} to "
                             "another folder")
    finally:
        tmp.unlink(missing_ok=True)
    try:
        yield folder
    finally:
        if owned and (_read_holder(lock) or {}).get("pid") == me["pid"]:
            lock.unlink(missing_ok=True)


# ---------------------------------------------------------------- disk and permission faults, by name
class WriteFailed(OSError):
    """A write that failed for space or permission; the message names the folder, the setting that moves it and
    what was kept."""


_DISK_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
                errno.EACCES: "permission denied", errno.EPERM: "permission denied",
                errno.EROFS: "the file system is read-only"}


def _free(folder: Path) -> str:
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return f"{shutil.disk_usage(p).free / 2**20:.0f} MiB free there"
    except OSError:
        return "free space unknown"


def disk_fault(exc: BaseException, folder: Path, setting: str,
               kept: "str | Callable[[], str]") -> Optional[WriteFailed]:
    """A WriteFailed saying what went wrong when `exc` is a space or permission fault (an OSError with such an errno,
    safetensors' SafetensorError naming one as "(os error N)", or torch's zip writer's "unexpected pos" /
    "PytorchStreamWriter failed" on a full disk), else None."""
    code = getattr(exc, "errno", None)
    rust = re.search(r"\(os error (\d+)\)", str(exc)) if not isinstance(exc, OSError) else None
    if isinstance(exc, OSError) and code in _DISK_ERRNOS:
        why = _DISK_ERRNOS[code]
    elif rust and int(rust.group(1)) in _DISK_ERRNOS:  # safetensors' SafetensorError wraps Rust's io::Error
        code = int(rust.group(1))
        why = _DISK_ERRNOS[code]
    elif isinstance(exc, RuntimeError) and any(s in str(exc) for s in ("unexpected pos", "PytorchStreamWriter")):
        why, code = "torch could not write the file (a full disk, most often)", errno.EIO
    else:
        return None
    fix = "free some space there" if code in (errno.ENOSPC, errno.EDQUOT, errno.EIO) else "make it writable"
    kept = kept() if callable(kept) else kept
    return WriteFailed(code, f"could not write to {folder}: {why} ({_free(folder)}; {type(exc).__name__}: "
                             f"{str(exc)[:200]}). {kept}. Fix: {fix}, or move it with {setting}=<another folder>")


@contextmanager
def named_writes(folder, setting: str, kept: "str | Callable[[], str]") -> Iterator[None]:
    """Turn a space or permission fault raised inside the block into a WriteFailed naming `folder`, `setting` (the
    config key or variable that moves it) and `kept` (what is still on disk and usable; a callable is asked at the
    failure)."""
    try:
        yield
    except Exception as e:  # OSError, torch's RuntimeError, safetensors' SafetensorError; any other is re-raised
        named = None if isinstance(e, WriteFailed) else disk_fault(e, Path(folder), setting, kept)
        if named is None:
            raise
        raise named from e


def check_writable(folder, setting: str) -> Path:
    """Create `folder` if needed and write a probe file into it, before minutes of work depend on it; raise
    WriteFailed naming the folder and `setting` otherwise."""
    folder = Path(folder).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-probe.{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        why = _DISK_ERRNOS.get(e.errno, f"{type(e).__name__}: {e}")
        raise WriteFailed(e.errno or errno.EIO, f"{folder} is not writable ({why}); nothing was started. Fix: make it "
                                                f"writable, or set {setting}=<a writable folder>") from e
    return folder
