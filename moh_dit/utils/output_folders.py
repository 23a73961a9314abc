"""The rules every command that writes an output folder follows (docs/design.md, "Output folders").

- **One writer per output folder.** :func:`hold_output_folder` takes an operating-system lock
  on ``.NAME.lock`` beside the resolved folder for as long as the command writes it; a second
  command writing the same folder, under any spelling, stops at once, naming the holder.
  Lock files are never written through a link, and a folder with a link below it is refused.
- **Nothing deleted that the package did not write.** Every output folder gets a marker,
  :data:`OUTPUT_MARKER`, saying which command wrote it; ``--overwrite`` replaces only a folder
  with that marker (or one its writer recognises, or an empty one): :func:`check_output_folder`.
- **Outputs never inside inputs.** :func:`check_outside_inputs` refuses an output folder that is,
  lies inside, or contains one of the command's input folders.

All checks run before any work and write nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

from ..errors import FolderInUse, InvalidInput, OutputExists
from .io import FileLockedError, LinkRefusedError, lock_file, write_json_atomic, write_lock_info

__all__ = ["OUTPUT_MARKER", "OutputFolderBusyError", "check_folder_path", "check_outside_inputs",
           "check_output_folder", "find_link_inside", "hold_output_folder", "is_package_output", "lock_path", "marked_by",
           "write_output_marker"]

OUTPUT_MARKER = ".moh-dit-output.json"


class OutputFolderBusyError(FolderInUse):
    """Another command is writing the output folder."""


def write_output_marker(folder: str | os.PathLike, command: str) -> Path:
    """Mark ``folder`` as written by ``moh-dit <command>``: what lets ``--overwrite`` replace it."""
    from .. import __version__

    return write_json_atomic(Path(folder) / OUTPUT_MARKER, {
        "written_by": f"moh-dit {command}", "version": __version__,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z")})


def marked_by(folder: str | os.PathLike) -> str | None:
    """Who wrote ``folder`` by its marker (``"moh-dit convert"``), or None when it has no
    readable marker; a marker reached through a link does not count."""
    marker = Path(folder) / OUTPUT_MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    written_by = info.get("written_by") if isinstance(info, dict) else None
    return written_by if isinstance(written_by, str) else None


def is_package_output(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` carries the marker of a moh-dit command."""
    return (marked_by(folder) or "").startswith("moh-dit ")


def check_output_folder(path: Path, overwrite: bool, is_ours: Callable[[Path], bool] | None = None,
                        what: str = "the output of a moh-dit command", named: str = "",
                        parameter: str = "output_dir") -> None:
    """Refuse ``path`` unless it can be created, or it is a folder ``overwrite`` may replace:
    empty, marked by a moh-dit command (:data:`OUTPUT_MARKER`), or recognised by ``is_ours``
    (outputs from before the marker). ``what`` says what is recognised, ``named`` (such as
    ``"output_dir "``) comes before the path where messages name it, and ``parameter`` is the
    one the advice tells to change. Nothing is written here."""
    shown = f"{named}{str(path)!r}"
    names = (parameter, "overwrite")
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise OutputExists(f"{shown} exists and is not a folder; choose another {parameter}", parameters=names)
        if not overwrite:
            raise OutputExists(f"{str(path)!r} already exists; delete it, choose another {parameter} or pass "
                               "overwrite", parameters=names)
        ours = is_package_output(path) or (is_ours is not None and is_ours(path))
        if not ours and any(path.iterdir()):
            # overwrite replaces what this writer made; it never deletes an unrelated folder.
            raise OutputExists(f"overwrite would replace {str(path)!r}, which is not {what}; choose another "
                               f"{parameter}, or delete it yourself", parameters=names)
    # Missing parent folders are created when the work starts; a file in their place cannot be.
    ancestor = path.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputExists(f"cannot create {shown}: {str(ancestor)!r} is a file", parameters=parameter)


def check_folder_path(path: str | os.PathLike, what: str, advice: str = "give a folder",
                      error: type[Exception] = ValueError) -> None:
    """Refuse a folder path that is a file or lies under one, before anything is made; the
    message names the path as ``what`` (a parameter such as ``output_dir``) and ends with ``advice``."""
    path = Path(path)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "is a file" if folder == path else f"lies under {folder}, which is a file"
                error = {FileExistsError: OutputExists, ValueError: InvalidInput}.get(error, error)
                raise error(f"{what} {path} {where}; {advice}.", parameters=what)
            return


def _inside(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_outside_inputs(output: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None],
                         output_flag: str = "output_dir") -> None:
    """Refuse an output folder that is, lies inside, or contains one of ``inputs`` (parameter ->
    path; None is skipped; ``output_flag`` names the output), comparing real paths (links resolved). What a command writes
    must never become what it reads: sample grids turning into training images, a cache
    replacing the data it was made from."""
    out = Path(output).resolve()
    for flag, source in inputs.items():
        if source is None:
            continue
        src = Path(source).resolve()
        if _inside(out, src) or _inside(src, out):
            where = "is" if out == src else ("lies inside" if _inside(out, src) else "contains")
            raise InvalidInput(f"{output_flag} {output} {where} {flag} {source}: a command never writes into what it "
                               f"reads; choose an {output_flag} outside {flag}.", parameters=(output_flag, flag))


def lock_path(folder: str | os.PathLike) -> Path:
    """The one-writer lock of ``folder``: ``.NAME.lock`` beside the folder it resolves to (links
    followed, ``..`` removed), so every spelling of one folder, a link to it included, meets
    the same lock."""
    real = Path(folder).expanduser().resolve()
    return real.parent / f".{real.name}.lock"


def find_link_inside(folder: str | os.PathLike) -> Path | None:
    """The first symbolic link anywhere below ``folder`` (not ``folder`` itself), or None.

    A command writes below its output folder by name: a link planted there (``samples/`` ->
    a user's folder) would redirect those writes outside the output, so a folder holding one
    is refused instead."""
    for parent, dirs, files in os.walk(folder):  # os.walk does not descend into linked folders
        for name in sorted(dirs + files):
            path = Path(parent) / name
            if path.is_symlink():
                return path
    return None


def _busy(folder: Path, parameter: str, holder: dict | None, lock: Path) -> OutputFolderBusyError:
    who = (f"{holder.get('command', 'a moh-dit command')}, pid {holder.get('pid')} on host {holder.get('host')}, "
           f"started {holder.get('started')}" if holder else "holder unknown: it is just starting")
    return OutputFolderBusyError(f"{parameter} {folder} is being written by another command ({who}; lock {lock}). "
                                 f"Wait for it to finish, or choose another {parameter}.", parameters=parameter)


@contextlib.contextmanager
def hold_output_folder(folder: str | os.PathLike, command: str, parameter: str = "output_dir") -> Iterator[None]:
    """Be the one writer of ``folder`` while the block runs (the folder need not exist yet).

    Every command that writes a folder, training included, takes this lock, :func:`lock_path`:
    beside the resolved folder, so it also covers writers that build the folder elsewhere and
    publish it whole, and every spelling of the folder meets it. The operating system releases
    it if the process dies, and the file is removed when the block ends. A second writer gets
    :class:`OutputFolderBusyError` naming the holder; a folder holding a symbolic link
    anywhere below it is refused (:class:`LinkRefusedError`, naming the link), since writes
    into it would follow the link. ``parameter`` names the folder in messages (the command
    line shows its flag). Take it after the read-only checks and before any work.
    """
    folder = Path(folder)
    lock = lock_path(folder)
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = lock_file(lock, create=True)
        except FileLockedError as error:
            raise _busy(folder, parameter, error.holder, lock) from None
        # The previous holder removes the file as it lets go: a lock taken on a file that is
        # no longer at ``lock`` holds nothing; take the new one.
        try:
            same = os.fstat(fd).st_ino == os.lstat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        link = find_link_inside(folder) if folder.is_dir() else None
        if link is not None:
            raise LinkRefusedError(
                f"{parameter} {folder} holds a symbolic link, {link} -> {os.readlink(link)}; a command never writes "
                f"through a link inside its output. Remove the link, or choose another {parameter}.",
                parameters=parameter)
        write_lock_info(fd, {"command": f"moh-dit {command}", "pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "argv": sys.argv})
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)
