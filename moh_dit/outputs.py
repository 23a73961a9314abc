"""What every command that writes files promises, kept in this one module.

- **One writer per output.** :func:`output_folder` holds a POSIX lock on ``.NAME.lock`` beside
  the resolved folder, so every spelling of one folder (a link to it included) meets the same
  lock. The kernel drops it the moment its holder dies; forked workers do not inherit it.
- **Overwrite only our own.** Each output folder carries :data:`MARKER`, naming the command
  that wrote it and, once finished, the files it wrote. ``overwrite`` replaces a folder only
  when the same command wrote it, and refuses, naming the file, when the folder holds a file
  that command did not write.
- **No output inside an input.** An output may not be, lie inside or contain an input folder;
  an input file protects that file, not its folder.
- **Atomic.** Files are written to scratch beside their final name (opened without following
  links, with the mode the umask gives) and renamed into place; whole folders are built in a
  scratch sibling and renamed. Scratch that a killed run left is removed by the next run of
  the same output, under the lock.
- **Failing early blocks nothing.** A folder a command created and left holding no result is
  removed when the command fails.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import IO, Iterator, Mapping

MARKER = ".moh-dit-output.json"
SCRATCH = ".moh-dit-tmp-"
_UMASK = os.umask(0)
os.umask(_UMASK)


# ----- atomic files ---------------------------------------------------------------------------

@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Write ``path`` through a scratch file beside it, renamed over ``path`` on success. The
    rename replaces a link at ``path`` itself, never the file it points to."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{SCRATCH}{path.name}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as error:  # a full disk names the file it was writing
        if error.filename is None and error.errno is not None:
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_json(path: str | os.PathLike, obj, **dump_kwargs) -> Path:
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=2, **dump_kwargs)
        f.write("\n")
    return Path(path)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_write(path) as f:
        f.write(data)
    return Path(path)


def read_json(path: str | os.PathLike):
    return json.loads(Path(path).read_text(encoding="utf-8"))


@contextlib.contextmanager
def publish_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Build a folder in a scratch sibling and rename it to ``path`` when the block succeeds:
    readers see the old folder or the complete new one, never half of one. Replacing an
    existing ``path`` is the caller's decision (:func:`output_folder` makes it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{SCRATCH}{path.name}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o777)  # the umask applies, as for any mkdir
    try:
        yield tmp
        mode = tmp.stat().st_mode & 0o666  # the umask's, as mkdir applied it
        for file in tmp.rglob("*"):  # safetensors writes its files readable by their owner alone
            if file.is_file() and not file.is_symlink():
                file.chmod(mode)
        old = None
        if path.exists() or path.is_symlink():
            old = path.parent / f"{SCRATCH}{path.name}-old-{secrets.token_hex(4)}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            _remove(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def remove_scratch(folder: Path, name: str | None = None) -> None:
    """Remove scratch left by a killed run: below ``folder``, or (with ``name``) the scratch
    of ``name`` beside it in ``folder``. Call it holding the output's lock."""
    if name is not None:
        for entry in folder.glob(f"{SCRATCH}{name}-*"):
            _remove(entry)
        return
    for parent, dirs, files in os.walk(folder):
        for entry in dirs + files:
            if entry.startswith(SCRATCH):
                _remove(Path(parent) / entry)
        dirs[:] = [d for d in dirs if not d.startswith(SCRATCH)]


# ----- the marker -----------------------------------------------------------------------------

def marked_by(folder: str | os.PathLike) -> str | None:
    """The command that wrote ``folder`` (``"moh-dit convert"``), by its marker, else None."""
    marker = Path(folder) / MARKER
    try:
        info = read_json(marker) if not marker.is_symlink() else None
    except (OSError, ValueError):
        return None
    return info.get("written_by") if isinstance(info, dict) else None


def _files_below(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir() and p.name != MARKER)


def write_marker(folder: Path, command: str, finished: bool, foreign: frozenset[str] = frozenset()) -> None:
    """``foreign``: files present that the command did not write (left out of the list)."""
    info = {"written_by": f"moh-dit {command}"}
    if finished:
        info["files"] = [name for name in _files_below(folder) if name not in foreign]
    write_json(folder / MARKER, info)


def _check_replaceable(path: Path, command: str) -> None:
    """Refuse to replace ``path`` unless it is empty or ``moh-dit COMMAND`` wrote it and all of it."""
    if not path.is_dir() or path.is_symlink():
        raise FileExistsError(errno.EEXIST, "exists and is not an output folder; choose another output", str(path))
    if not any(path.iterdir()):
        return
    writer = marked_by(path)
    if writer != f"moh-dit {command}":
        by = f"written by {writer}" if writer else "not written by moh-dit"
        raise FileExistsError(errno.EEXIST, f"{by}; overwrite replaces only a folder that moh-dit {command} wrote",
                              str(path))
    listed = read_json(path / MARKER).get("files")
    if listed is not None:
        listed = set(listed)
        for name in _files_below(path):
            if name not in listed and not Path(name).name.startswith(SCRATCH):
                raise FileExistsError(errno.EEXIST, "overwrite never deletes a file moh-dit did not write; "
                                      "move it away first", str(path / name))


# ----- inputs and the lock --------------------------------------------------------------------

def check_outside_inputs(output: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None]) -> None:
    """Refuse an output that is, lies inside or contains an input folder, or that is or contains
    an input file (links resolved); ``inputs`` maps a name for messages to a path or None."""
    out = Path(output).resolve()
    for name, source in inputs.items():
        if source is None or "://" in str(source):
            continue
        src = Path(source).resolve()
        if src == out or out in src.parents or (src.is_dir() and src in out.parents):
            raise ValueError(f"the output {output} would overlap the input {name} {source}; "
                             "a command never writes into what it reads")


_HELD: set[Path] = set()  # POSIX locks do not exclude their own process: refuse a second hold here


def lock_path(folder: str | os.PathLike) -> Path:
    real = Path(folder).expanduser().resolve()
    return real.parent / f".{real.name}.lock"


@contextlib.contextmanager
def hold_lock(folder: str | os.PathLike, command: str) -> Iterator[None]:
    """Be the one writer of ``folder`` (it need not exist) while the block runs."""
    lock = lock_path(folder)
    if lock in _HELD:
        raise FileExistsError(errno.EBUSY, "being written by this process; choose another output", str(folder))
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # per process: a fork does not inherit it
        except OSError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another command"
            os.close(fd)
            raise FileExistsError(errno.EBUSY, f"being written by {holder}; wait for it or choose another output",
                                  str(folder)) from None
        try:  # the last holder unlinks the file as it lets go: a lock on an unlinked file holds nothing
            if os.fstat(fd).st_ino == os.lstat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"moh-dit {command} (pid {os.getpid()})".encode())
        _HELD.add(lock)
        yield
    finally:
        _HELD.discard(lock)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


# ----- the one entry point --------------------------------------------------------------------

@contextlib.contextmanager
def output_folder(path: str | os.PathLike, command: str, *, overwrite: bool = False, resume: bool = False,
                  inputs: Mapping[str, str | os.PathLike | None] | None = None, publish: bool = False,
                  setup: tuple[str, ...] = ()) -> Iterator[Path]:
    """Hold ``path`` as the output of ``moh-dit COMMAND`` while the block writes it.

    ``publish=True``: the block builds the folder in scratch (the yielded path), renamed to
    ``path`` on success, so nothing half-written appears under its name. Otherwise the block
    writes into ``path`` itself (a run, a sample folder) and ``resume=True`` keeps a folder
    the same command wrote. Either way an existing folder is replaced only with ``overwrite``
    and only when :func:`_check_replaceable` allows it. If the block fails in a folder it
    created that holds nothing but the marker and the ``setup`` files, the folder goes, so a
    rerun is not blocked. The marker lists the files once the block succeeds.
    """
    path = Path(path)
    check_outside_inputs(path, inputs or {})
    with hold_lock(path, command):
        exists = path.exists() or path.is_symlink()
        if exists and resume and not publish and marked_by(path) == f"moh-dit {command}":
            pass
        elif exists and not overwrite:
            raise FileExistsError(errno.EEXIST, "already exists; pass overwrite (--overwrite) to replace it"
                                  + (" or resume (--resume) to continue it" if not publish else ""), str(path))
        elif exists:
            _check_replaceable(path, command)
        remove_scratch(path.parent, path.name)
        if publish:
            with publish_folder(path) as tmp:
                yield tmp
                write_marker(tmp, command, finished=True)
            return
        if exists and not (resume and marked_by(path) == f"moh-dit {command}"):
            _remove(path)
            exists = False
        foreign = frozenset()
        if exists:  # resumed: a file that was there but not in the finished list is the user's
            remove_scratch(path)
            listed = read_json(path / MARKER).get("files")
            if listed is not None:
                foreign = frozenset(_files_below(path)) - set(listed)
        path.mkdir(parents=True, exist_ok=True)
        if not exists:
            write_marker(path, command, finished=False)
        try:
            yield path
        except BaseException:
            if not exists and all(n in setup for n in _files_below(path)):
                shutil.rmtree(path, ignore_errors=True)
            raise
        write_marker(path, command, finished=True, foreign=foreign)
