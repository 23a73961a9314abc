"""Which output folder a dataset writer (the demo dataset, the latent cache) may create or replace.

Both build their output in a temporary sibling and publish it with
:func:`moh_dit.utils.io.publish_folder`; this is the check they run first, before any work:
``--overwrite`` replaces only a folder the same writer made (or an empty one), never a file
or an unrelated folder, and a file where a parent folder must be created is refused up front.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

__all__ = ["check_folder_path", "check_output_folder"]


def check_output_folder(path: Path, overwrite: bool, is_ours: Callable[[Path], bool], what: str,
                        named: str = "", flag: str = "--output-dir") -> None:
    """Refuse ``path`` unless it can be created, or it is a folder ``overwrite`` may replace:
    empty, or recognised by ``is_ours``. ``what`` says what ``is_ours`` recognises, ``named``
    (such as ``"--output-dir "``) comes before the path where messages name it, and ``flag``
    is the option the advice tells to change. Nothing is written here."""
    shown = f"{named}{str(path)!r}"
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise FileExistsError(f"{shown} exists and is not a folder; choose another {flag}")
        if not overwrite:
            raise FileExistsError(
                f"{str(path)!r} already exists; delete it, choose another {flag} or pass --overwrite"
            )
        if not is_ours(path) and any(path.iterdir()):
            # --overwrite replaces what this writer made; it never deletes an unrelated folder.
            raise FileExistsError(
                f"--overwrite would replace {str(path)!r}, which is not {what}; choose another {flag}, "
                "or delete it yourself"
            )
    # Missing parent folders are created when the work starts; a file in their place cannot be.
    ancestor = path.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise FileExistsError(f"cannot create {shown}: {str(ancestor)!r} is a file")


def check_folder_path(path: str | os.PathLike, what: str, advice: str = "give a folder",
                      error: type[Exception] = ValueError) -> None:
    """Refuse a folder path that is a file or lies under one, before anything is made; the
    message names the path as ``what`` (a flag such as ``--output``) and ends with ``advice``."""
    path = Path(path)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "is a file" if folder == path else f"lies under {folder}, which is a file"
                raise error(f"{what} {path} {where}; {advice}.")
            return
