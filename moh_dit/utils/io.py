"""Atomic file writes: a file either does not exist or is complete.

Everything the package writes that a later run reads back (JSON settings, checkpoints'
markers, sample PNGs, cached statistics, sweep tables) goes through these: the data is
written to a temporary file in the same folder and renamed over the target, which is
atomic on POSIX file systems; on failure the temporary file is removed.

Also here: SHA-256 of a file (checkpoint integrity) and an exclusive lock on a file that
the operating system releases when the holding process dies (one training run per folder).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import IO, Any, Iterator

__all__ = ["FileLockedError", "atomic_write", "lock_file", "publish_folder", "read_lock_info", "sha256_file",
           "write_bytes_atomic", "write_json_atomic", "write_lines_atomic", "write_lock_info"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; rename it to ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file owner-only (0600); give it the mode an ordinary open() would.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def publish_folder(path: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Build a folder in a temporary sibling and rename it to ``path`` when the block succeeds.

    Readers see either no folder, the old one or the complete new one, never a half-written
    one. With ``replace=True`` an existing ``path`` is first renamed aside and deleted only
    after the new folder is in place, so a crash at any moment leaves one complete copy
    (the old one may then remain as ``.NAME.old-*`` beside it). Whether replacing is allowed
    is the caller's decision, checked before any work; without ``replace`` an existing
    ``path`` raises FileExistsError. On failure the temporary folder is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        if path.exists() and not replace:
            raise FileExistsError(f"{path} already exists; nothing was replaced")
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_write(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj: Any, sort_keys: bool = False) -> Path:
    """``obj`` as indented JSON (with a final newline), written atomically."""
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=sort_keys)
        f.write("\n")
    return Path(path)


def write_lines_atomic(path: str | os.PathLike, lines: list[str]) -> Path:
    """Text lines (each given without its newline), written atomically."""
    with atomic_write(path, "w") as f:
        f.writelines(line + "\n" for line in lines)
    return Path(path)


def sha256_file(path: str | os.PathLike, fsync: bool = False) -> str:
    """Hex SHA-256 of a file's bytes, read in 8 MiB blocks. ``fsync`` also flushes the file
    to disk first, so that the hash recorded for it describes what survives a power cut."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if fsync:
            os.fsync(f.fileno())
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class FileLockedError(BlockingIOError):
    """Another process holds the lock; ``holder`` is what it wrote into the lock file (or None)."""

    def __init__(self, path: Path, holder: dict | None):
        super().__init__(errno.EWOULDBLOCK, f"{path} is locked by another process")
        self.path, self.holder = path, holder


def lock_file(path: str | os.PathLike, create: bool = True) -> int | None:
    """An open descriptor holding an exclusive ``fcntl.flock`` on ``path``; close it to release.

    The lock is the operating system's: it goes away when the process exits or is killed,
    so a crashed holder never leaves a stale lock. It is advisory (only processes that ask
    for it are kept out) and, on network file systems without lock support, may only
    cover processes on the same machine. Opening an existing file does not change it;
    with ``create=False`` a missing file gives None (nothing is created). Raises
    :class:`FileLockedError` when another process holds the lock, and OSError naming the
    file when the file system refuses locks (ENOLCK).
    """
    import fcntl

    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FileLockedError(path, read_lock_info(path)) from None
    except OSError as error:
        os.close(fd)
        raise OSError(error.errno, f"cannot lock {path} ({os.strerror(error.errno or 0)}): the file system does "
                      "not support file locks; use a folder on a local disk or on a file system with lock "
                      "support") from None
    return fd


def write_lock_info(fd: int, info: dict) -> None:
    """Replace the lock file's content with ``info`` (JSON): who holds it, for others to read."""
    data = (json.dumps(info) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def read_lock_info(path: str | os.PathLike) -> dict | None:
    """What the holder wrote into a lock file, or None (missing, empty, or being written)."""
    try:
        info = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None
