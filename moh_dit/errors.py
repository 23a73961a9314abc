"""The package's errors: one small hierarchy, messages in the library's terms.

Every error the package raises on purpose is a :class:`MoHDiTError`. Its message names the
Python parameter at fault the way a caller typed it (``output_dir``, ``head_activation_ratio``),
and ``parameters`` lists those names, so that the command line can say ``--output-dir`` instead:
the commands render the message with their own parser's table of flags
(:meth:`MoHDiTError.for_command`), and no library module mentions a flag.

Each subclass also derives from the built-in exception a caller would expect, so
``except ValueError`` / ``except FileExistsError`` keep working:

=====================  ====================  ==========================================
class                  also a                raised when
=====================  ====================  ==========================================
``InvalidInput``       ``ValueError``        a value given is wrong or does not fit
``InputNotFound``      ``FileNotFoundError`` a file or folder given does not exist
``FolderInUse``        ``FileExistsError``   another process writes the folder
``OutputExists``       ``FileExistsError``   the output holds what this call may not replace
``DamagedFile``        ``ValueError``        a file is truncated, unreadable or fails its hash
``TrainingDiverged``   ``FloatingPointError``  the loss or the weights became NaN / inf
=====================  ====================  ==========================================
"""

from __future__ import annotations

import re
from typing import Mapping  # as the model modules bundled with it (hub.bundle: one name, one meaning)

__all__ = ["MoHDiTError", "InvalidInput", "InputNotFound", "FolderInUse", "OutputExists", "DamagedFile", "TrainingDiverged"]


class MoHDiTError(Exception):
    """Base class. ``parameters``: the names of the parameters the message is about."""

    def __init__(self, message: str, *, parameters: str | tuple[str, ...] = ()):
        super().__init__(message)
        self.parameters = (parameters,) if isinstance(parameters, str) else tuple(parameters)

    def for_command(self, flags: Mapping[str, str]) -> str:
        """The message with each of ``parameters`` written as its flag (``flags``: parameter ->
        ``--flag``, e.g. from the command's parser); names without a flag stay as they are."""
        message = str(self)
        for name in self.parameters:
            if name in flags:
                # The name as a word, not inside another name (cfg.output_dir, output_dir_name), a path
                # (runs/classifier/x) or a file name (classifier.json).
                message = re.sub(rf"(?<![\w./\\-]){re.escape(name)}(?![\w/\\]|\.\w)", flags[name], message)
        return message


class InvalidInput(MoHDiTError, ValueError):
    """A value given to the package is wrong, out of range, or does not fit the model, the data
    or the machine."""


class InputNotFound(MoHDiTError, FileNotFoundError):
    """A file or folder given to the package does not exist (the message names it)."""


class FolderInUse(MoHDiTError, FileExistsError):
    """Another process is writing the folder (the message names it)."""


class OutputExists(MoHDiTError, FileExistsError):
    """The output already holds something this call may not replace."""


class DamagedFile(MoHDiTError, ValueError):
    """A file the package reads is truncated, unreadable or fails its recorded hash."""


class TrainingDiverged(MoHDiTError, FloatingPointError):
    """Training produced NaN or inf (loss, gradients or weights)."""
