"""The trainer's own errors, and its one-line warnings on stderr."""

from __future__ import annotations

import sys


class TrainingDivergedError(FloatingPointError):
    """The loss became NaN or infinite."""


class RunFolderBusyError(FileExistsError):
    """Another training run holds the ``--output-dir`` (the message names its pid, host and start)."""


class CheckpointIntegrityError(ValueError):
    """A checkpoint file is missing, truncated, altered or unreadable (the message names it)."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)
