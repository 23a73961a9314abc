"""What the convert, upcycle, export, classifier and demo-data commands share about their output
folders, on top of :mod:`moh_dit.utils.output_folders`:

- :func:`check_replaceable`: ``overwrite`` replaces an empty folder, one carrying this
  command's own marker, or one the command recognises as its earlier (pre-marker) output.
  A folder marked by another command (a training run, an export) is never replaced by this
  one: its ``overwrite`` is about its own outputs only.

Also re-exported for these commands: ``naming_write_errors`` (:mod:`moh_dit.utils.io`) and
``marked_by`` (:mod:`moh_dit.utils.output_folders`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ..errors import OutputExists
from ..utils.io import naming_write_errors
from ..utils.output_folders import check_output_folder, marked_by

__all__ = ["check_replaceable", "local_path", "marked_by", "naming_write_errors"]


def local_path(source: str | os.PathLike | None) -> str | os.PathLike | None:
    """``source`` when it is an existing local file or folder, else None (a URL, a Hub id, nothing):
    the inputs an output folder must stay outside of."""
    return source if source is not None and Path(source).expanduser().exists() else None


def check_replaceable(path: Path, overwrite: bool, command: str, is_ours: Callable[[Path], bool] | None, what: str,
                      parameter: str = "output_dir") -> None:
    """Refuse ``path`` (the caller's ``parameter``) unless it can be created or ``overwrite`` may
    replace it (see the module docstring); ``what`` says what ``command`` recognises, for the
    refusal. Writes nothing."""
    check_output_folder(path, overwrite, is_ours, what=what, named=f"{parameter} ", parameter=parameter)
    writer = marked_by(path) if path.is_dir() else None
    if writer is not None and writer != f"moh-dit {command}":
        raise OutputExists(f"overwrite would replace {str(path)!r}, which {writer} wrote, not moh-dit {command}; "
                           f"choose another {parameter}, or delete it yourself", parameters=(parameter, "overwrite"))
