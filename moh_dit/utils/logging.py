"""The package's messages: one ``moh_dit`` logger, quiet for library callers, informative for
the commands.

Library code logs with ``get_logger(__name__)``; nothing in the package prints. A Python
caller sees warnings and errors only (the level is ``WARNING`` unless ``MOH_DIT_VERBOSITY``
says otherwise), as with diffusers' loggers. The commands call :func:`set_verbosity` from their
``--quiet`` / ``--verbose`` flags (``INFO`` by default). Messages go to the *current*
``sys.stdout`` (info and debug) or ``sys.stderr`` (warnings and errors) at the time they are
logged, so redirecting or capturing the streams captures them.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LEVELS", "get_logger", "set_verbosity", "get_verbosity"]

ROOT = "moh_dit"
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
        env = os.environ.get("MOH_DIT_VERBOSITY", "warning").strip().lower()
        logger.setLevel(LEVELS.get(env, logging.WARNING))
    return logger


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (under ``moh_dit``), with the package's handler set up."""
    _root()
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


def set_verbosity(level: int | str) -> None:
    """Set the package's log level: ``"debug"``, ``"info"``, ``"warning"``, ``"error"`` or a
    ``logging`` level."""
    if isinstance(level, str):
        if level.lower() not in LEVELS:
            raise ValueError(f"verbosity {level!r}; choose one of {', '.join(LEVELS)}.")
        level = LEVELS[level.lower()]
    _root().setLevel(level)


def get_verbosity() -> int:
    return _root().getEffectiveLevel()
