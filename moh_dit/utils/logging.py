"""The package's messages: one ``moh_dit`` logger, quiet for library callers, informative for
the commands.

Library code logs with ``get_logger(__name__)``; nothing in the package prints. A Python
caller sees warnings and errors only (the level is ``WARNING`` unless ``MOH_DIT_VERBOSITY``
says otherwise), as with diffusers' loggers. A command runs at the level of its ``--quiet`` /
``--verbose`` flags, else ``MOH_DIT_VERBOSITY`` when set, else ``INFO`` (its progress), inside
:func:`verbosity`, which puts the previous level back when the command returns. Progress bars
follow the same switch (:func:`info_enabled`). Messages go to the *current* ``sys.stdout``
(info and debug) or ``sys.stderr`` (warnings and errors) at the time they are logged, so
redirecting or capturing the streams captures them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator

__all__ = ["LEVELS", "command_level", "get_logger", "get_verbosity", "info_enabled", "set_verbosity", "verbosity"]

ROOT = "moh_dit"
ENV = "MOH_DIT_VERBOSITY"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _CurrentStreamHandler(logging.Handler):
    """Info and debug to the current ``sys.stdout``, the rest to the current ``sys.stderr``,
    the message alone (warnings prefixed with ``warning:``)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if record.levelno >= logging.WARNING:
                stream, message = sys.stderr, f"{record.levelname.lower()}: {message}"
            else:
                stream = sys.stdout
            stream.write(message + "\n")
            stream.flush()
        except Exception:  # a logging failure must not end the run
            self.handleError(record)


def _root() -> logging.Logger:
    logger = logging.getLogger(ROOT)
    if not any(isinstance(h, _CurrentStreamHandler) for h in logger.handlers):
        logger.addHandler(_CurrentStreamHandler())
        logger.propagate = False
        env = os.environ.get(ENV, "warning").strip().lower()
        logger.setLevel(LEVELS.get(env, logging.WARNING))
    return logger


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (under ``moh_dit``), with the package's handler set up."""
    _root()
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


def _level(level: int | str) -> int:
    if isinstance(level, str):
        if level.lower() not in LEVELS:
            raise ValueError(f"verbosity {level!r}; choose one of {', '.join(LEVELS)}.")
        return LEVELS[level.lower()]
    return level


def set_verbosity(level: int | str) -> None:
    """Set the package's log level: ``"debug"``, ``"info"``, ``"warning"``, ``"error"`` or a
    ``logging`` level."""
    _root().setLevel(_level(level))


def get_verbosity() -> int:
    return _root().getEffectiveLevel()


def info_enabled() -> bool:
    """Whether info messages show now: the switch for progress bars, which ``--quiet`` hides too."""
    return _root().isEnabledFor(logging.INFO)


@contextlib.contextmanager
def verbosity(level: int | str) -> Iterator[None]:
    """Log at ``level`` inside the block, then at the level from before (a command run from
    Python leaves the library as quiet as it found it)."""
    root = _root()
    before = root.level
    root.setLevel(_level(level))
    try:
        yield
    finally:
        root.setLevel(before)


def command_level(flag: str | None) -> str:
    """A command's level: its ``--quiet`` / ``--verbose`` flag, else ``MOH_DIT_VERBOSITY`` when
    it names a level, else ``"info"`` (commands show their progress)."""
    if flag:
        return flag
    env = os.environ.get(ENV, "").strip().lower()
    return env if env in LEVELS else "info"
