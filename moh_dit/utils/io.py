"""Atomic file writes: a file either does not exist or is complete.

Everything the package writes that a later run reads back (JSON settings, checkpoints'
markers, sample PNGs, cached statistics, sweep tables) goes through these: the data is
written to a temporary file in the same folder and renamed over the target, which is
atomic on POSIX file systems; on failure the temporary file is removed.

What is written or published gets the permissions an ordinary ``open`` / ``mkdir`` would give
under the process's umask (0644 / 0755 with umask 022, 0600 / 0700 with umask 077), not the
owner-only modes of ``mkstemp`` / ``mkdtemp`` or of libraries that write through them: a model
folder on a shared disk is readable by whoever the umask lets read it. Only lock files and
scratch folders that are never published stay as they are made.

Also here: SHA-256 of a file (checkpoint integrity) and an exclusive lock on a file that
the operating system releases when the holding process dies (one training run per folder).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import uuid
from pathlib import Path
from typing import IO, Any, Iterator

from ..errors import OutputExists

__all__ = ["FileLockedError", "LinkRefusedError", "atomic_write", "naming_path", "naming_write_errors", "current_umask", "lock_file", "publish_folder", "read_lock_info", "remove_stale_scratch",
           "set_ordinary_permissions", "sha256_file", "write_bytes_atomic", "write_json_atomic", "write_lines_atomic",
           "write_lock_info"]


def current_umask() -> int:
    """The process's umask (POSIX can only tell it by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _ordinary_mode(directory: bool, executable: bool, umask: int) -> int:
    """What ``mkdir`` (0777) or ``open`` (0666, or 0777 for an executable) gives under ``umask``."""
    return (0o777 if directory or executable else 0o666) & ~umask


def set_ordinary_permissions(root: str | os.PathLike) -> None:
    """Give ``root`` and everything under it the modes an ordinary ``mkdir`` / ``open`` would
    give under the current umask (a file with its owner's execute bit keeps it executable).

    Files made by ``mkstemp``, ``mkdtemp`` or libraries that write through a private temporary
    file (safetensors) are owner-only whatever the umask; this undoes that before a folder is
    published. Symbolic links are left alone (a mode change would reach their targets).
    """
    umask, root = current_umask(), Path(root)
    if root.is_symlink():
        return
    if not root.is_dir():
        os.chmod(root, _ordinary_mode(False, bool(root.stat().st_mode & stat.S_IXUSR), umask))
        return
    os.chmod(root, _ordinary_mode(True, False, umask))
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            if path.is_symlink():
                continue
            mode = path.stat().st_mode
            os.chmod(path, _ordinary_mode(stat.S_ISDIR(mode), bool(mode & stat.S_IXUSR), umask))


def naming_path(error: OSError, path: str | os.PathLike) -> OSError:
    """``error`` as an OSError of the same errno whose message names ``path``: a failed
    ``write`` (disk full, quota, I/O error) says which file it was writing, so the command's
    one-line error can name it."""
    if error.filename is not None or error.errno is None:
        return error
    return type(error)(error.errno, f"{os.strerror(error.errno)} while writing {path}", str(path))


# The kinds of Rust's std::io::ErrorKind that safetensors prints when it has no errno.
_IO_KINDS = {"StorageFull": errno.ENOSPC, "QuotaExceeded": errno.EDQUOT, "FilesystemQuotaExceeded": errno.EDQUOT,
             "ReadOnlyFilesystem": errno.EROFS, "PermissionDenied": errno.EACCES}


def _errno_of(text: str) -> int | None:
    """The errno a third-party error message reports (``os error 28``, ``code: 28``, ``StorageFull``)."""
    found = re.search(r"(?:os error|code:)\s*(\d+)", text)
    if found:
        return int(found.group(1))
    for kind, code in _IO_KINDS.items():
        if kind in text:
            return code
    return errno.ENOSPC if "No space left" in text else None


@contextlib.contextmanager
def naming_write_errors(path: str | os.PathLike) -> Iterator[None]:
    """Let a failed write in the block (a full disk, a quota, a read-only file system) raise an
    OSError of its errno that names ``path``, whichever library was writing: an OSError without
    a file name, and safetensors' ``SafetensorError`` (not an OSError) caused by one."""
    try:
        yield
    except OSError as error:
        named = naming_path(error, path)
        if named is error:
            raise
        raise named from error
    except Exception as error:  # noqa: BLE001 - only safetensors' I/O errors become OSErrors
        code = _errno_of(str(error)) if type(error).__name__ == "SafetensorError" else None
        if code is None:
            raise
        raise OSError(code, f"{os.strerror(code)} while writing {path}", str(path)) from error


def _scratch_prefix(path: Path, kind: str) -> str:
    """Name prefix of this process's scratch files and folders for ``path``: the host and pid
    in the name tell a later run which ones a killed process left behind."""
    return f".{path.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


# Folders this process has already cleaned: each is listed once, not at every write into it
# (a sample folder receives tens of thousands of files).
_cleaned: set[tuple[int, Path]] = set()


def remove_stale_scratch(folder: str | os.PathLike) -> None:
    """Remove the scratch files and folders that a process of this host left in ``folder`` when
    it was killed before finishing (names ``.NAME.tmp-HOST-PID-*`` / ``.NAME.part-HOST-PID-*``
    whose PID is not running). Scratch of live processes, of other hosts, and links are left
    alone. Each folder is looked at once per process."""
    folder = Path(folder).absolute()
    if (os.getpid(), folder) in _cleaned or not folder.is_dir():
        return
    _cleaned.add((os.getpid(), folder))
    scratch = re.compile(rf"^\..+\.(?:tmp|part)-{re.escape(socket.gethostname())}-(\d+)-")
    for entry in folder.iterdir():
        found = scratch.match(entry.name)
        if found and not entry.is_symlink() and not _alive(int(found.group(1))):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; rename it to ``path`` on success.
    The rename replaces a symbolic link at ``path`` itself, never the file it points to. An
    OSError while writing (disk full, say) names ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_scratch(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_scratch_prefix(path, "part"))
    try:
        # mkstemp makes the file owner-only (0600); give it the mode an ordinary open() would.
        os.fchmod(fd, _ordinary_mode(False, False, current_umask()))
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            try:
                yield f
                f.flush()
                os.fsync(f.fileno())
            except OSError as error:
                raise naming_path(error, path) from None
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
    ``path`` raises FileExistsError. On failure the temporary folder is removed, and one that a
    killed earlier run left beside ``path`` is removed when the next one starts.

    The published folder and everything in it get the permissions an ordinary ``mkdir`` /
    ``open`` gives under the umask (:func:`set_ordinary_permissions`), whoever wrote the files;
    while it is being built the temporary folder stays owner-only, as ``mkdtemp`` makes it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_scratch(path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=_scratch_prefix(path, "tmp"), dir=path.parent))
    try:
        yield tmp
        set_ordinary_permissions(tmp)
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


class LinkRefusedError(OutputExists):
    """A lock or record file, or something inside an output folder, is a symbolic link: the
    package never writes through one."""


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
    :class:`FileLockedError` when another process holds the lock, :class:`LinkRefusedError`
    when ``path`` is a symbolic link (the holder's details would be written through it into
    whatever it points to), and OSError naming the file when the file system refuses locks.
    """
    import fcntl

    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:  # O_NOFOLLOW met a link (to a file, a folder or nothing)
            raise LinkRefusedError(f"{path} is a symbolic link, and a lock file is never written through a link; "
                                   "delete the link and run the command again") from None
        raise
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
