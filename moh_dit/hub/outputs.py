"""What the convert, upcycle, export, classifier and demo-data commands share about their output
folders, on top of :mod:`moh_dit.utils.output_folders`:

- :func:`check_replaceable`: ``--overwrite`` replaces an empty folder, one carrying this
  command's own marker, or one the command recognises as its earlier (pre-marker) output.
  A folder marked by another command (a training run, an export) is never replaced by this
  one: its ``--overwrite`` is about its own outputs only.
- :func:`naming_write_errors`: a failed write while building an output folder (disk full,
  quota, read-only file system) becomes an OSError with its errno that names the folder,
  including the errors of safetensors, whose ``SafetensorError`` is not an OSError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path
from typing import Callable, Iterator

from ..utils.io import naming_path
from ..utils.output_folders import check_output_folder, marked_by

__all__ = ["check_replaceable", "local_path", "marked_by", "naming_write_errors"]

# The kinds of Rust's std::io::ErrorKind that safetensors prints when it has no errno.
_IO_KINDS = {"StorageFull": errno.ENOSPC, "QuotaExceeded": errno.EDQUOT, "ReadOnlyFilesystem": errno.EROFS,
             "PermissionDenied": errno.EACCES, "FilesystemQuotaExceeded": errno.EDQUOT}


def local_path(source: str | os.PathLike | None) -> str | os.PathLike | None:
    """``source`` when it is an existing local file or folder, else None (a URL, a Hub id, nothing):
    the inputs an output folder must stay outside of."""
    return source if source is not None and Path(source).expanduser().exists() else None


def check_replaceable(path: Path, overwrite: bool, command: str, is_ours: Callable[[Path], bool] | None, what: str,
                      flag: str = "--output-dir") -> None:
    """Refuse ``path`` unless it can be created or ``overwrite`` may replace it (see the module
    docstring); ``what`` says what ``command`` recognises, for the refusal. Writes nothing."""
    check_output_folder(path, overwrite, is_ours, what=what, named=f"{flag} ", flag=flag)
    writer = marked_by(path) if path.is_dir() else None
    if writer is not None and writer != f"moh-dit {command}":
        raise FileExistsError(f"--overwrite would replace {str(path)!r}, which {writer} wrote, not moh-dit {command}; "
                              f"choose another {flag}, or delete it yourself")


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
    """Let an OSError (or a ``SafetensorError`` caused by one) raised in the block name ``path``
    and keep its errno, so the command reports it in one line (disk full, quota, ...)."""
    try:
        yield
    except OSError as error:
        raise naming_path(error, path) from error
    except Exception as error:  # noqa: BLE001 - only safetensors' I/O errors are turned into OSError
        if type(error).__name__ != "SafetensorError":
            raise
        code = _errno_of(str(error))
        if code is None:
            raise
        raise OSError(code, f"{os.strerror(code)} while writing {path}", str(path)) from error
