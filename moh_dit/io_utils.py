"""Atomic file writes: a file either does not exist or is complete.

Everything the package writes that a later run reads back (JSON settings, checkpoints'
markers, sample PNGs, cached statistics, sweep tables) goes through these: the data is
written to a temporary file in the same folder and renamed over the target, which is
atomic on POSIX file systems; on failure the temporary file is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

__all__ = ["atomic_write", "write_bytes_atomic", "write_json_atomic"]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; rename it to ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
