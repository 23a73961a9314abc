"""The commands' common parts: the argument parser every command uses, the decorator that runs
a command's ``main`` at the level of its flags, and the entry point that turns expected errors
into one line instead of a traceback."""

from __future__ import annotations

import argparse
import errno
import functools
import sys
from typing import Any, Callable, Sequence

from ..errors import MoHDiTError
from .logging import command_level, get_logger, verbosity

__all__ = ["ArgumentParser", "command", "run_cli"]

logger = get_logger(__name__)

# Errors that mean bad input or a bad environment, which the message explains; anything
# else is a bug and keeps its traceback.
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (MoHDiTError, ValueError, FileNotFoundError, FileExistsError)

# Faults of the machine rather than of the code: a full disk, a quota, a read-only or failing
# file system, a missing permission. Every command reports them in one line naming the path.
ENVIRONMENT_ERRNOS = frozenset(getattr(errno, name) for name in
                               ("ENOSPC", "EDQUOT", "EROFS", "EIO", "EACCES", "EPERM", "ENAMETOOLONG", "EMFILE",
                                "ENFILE", "ENOTDIR", "EISDIR", "ENOLCK", "EXDEV") if hasattr(errno, name))


def environment_fault(error: BaseException) -> str | None:
    """The one-line message for an error of the machine (see ENVIRONMENT_ERRNOS, and running out
    of memory), or None for any other error."""
    if isinstance(error, MemoryError):
        return ("out of memory" + (f" ({error})" if str(error) else "")
                + "; use a smaller batch size or sample count, or a machine with more memory")
    if isinstance(error, OSError) and error.errno in ENVIRONMENT_ERRNOS:
        text = error.strerror or str(error)
        named = [str(f) for f in (error.filename, error.filename2) if f is not None and str(f) not in text]
        return text + (f": {' -> '.join(named)}" if named else "")
    return None


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with the spellings diffusers' and accelerate's users type.

    Every ``--some-flag`` also answers to ``--some_flag`` (diffusers' example scripts spell
    flags with underscores), and :meth:`add_alias` adds further names for a flag (e.g.
    ``--train_data_dir`` for ``--data-dir``); neither shows in ``--help``, which lists each
    flag once. ``-q/--quiet`` (warnings and errors only) and ``-v/--verbose`` (debug messages)
    set the package's log level (``moh_dit.utils.logging``); the default shows progress.
    Each command names its parser ``moh-dit <command>`` (``prog=command_prog(__spec__.name)``),
    so usage lines and errors read the same however it was started (``moh-dit``,
    ``python scripts/X.py``, ``python -m``, ``cli(argv)``).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._aliases: dict[str, str] = {}
        verbosity = self.add_mutually_exclusive_group()
        verbosity.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const="warning",
                               help="print only warnings and errors")
        verbosity.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const="debug",
                               help="also print debug messages")
        self.add_argument("--debug", action="store_true",
                          help="on an error, show the full traceback instead of the one-line message")

    def add_alias(self, alias: str, flag: str) -> None:
        """Let ``alias`` (``--name``, any spelling) stand for the existing ``flag``."""
        if flag not in self._option_string_actions:
            raise ValueError(f"add_alias: {flag} is not a flag of this parser.")
        self._aliases[alias.replace("_", "-")] = flag

    def _spelled(self, arg: str) -> str:
        if not arg.startswith("--") or arg == "--":
            return arg
        name, eq, value = arg.partition("=")
        if name in self._option_string_actions:
            return arg
        dashed = name.replace("_", "-")
        flag = self._aliases.get(dashed) or (dashed if dashed in self._option_string_actions else None)
        return arg if flag is None else flag + eq + value

    # parameter -> flag of the parser that parsed last: how run_cli names a library error's
    # parameters (``output_dir`` -> ``--output-dir``), so the flags live in the parsers alone.
    last_flags: dict[str, str] = {}

    def flags(self) -> dict[str, str]:
        """Each argument's destination (the library's parameter name) -> its first long flag."""
        return {action.dest: next(s for s in action.option_strings if s.startswith("--"))
                for action in self._actions if any(s.startswith("--") for s in action.option_strings)}

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):
        ArgumentParser.last_flags = self.flags()
        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)  # after "--" everything is a value
        return super().parse_known_args([self._spelled(a) for a in args[:end]] + args[end:], namespace)


def command(main: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Decorate a command's ``main(args)`` so that it runs at the level its arguments ask for
    (``--quiet``, ``--verbose``, else ``MOH_DIT_VERBOSITY``, else info): called from Python
    with parsed arguments, it shows what the command shows, then restores the library's level."""

    @functools.wraps(main)
    def run(args: Any) -> Any:
        with verbosity(command_level(getattr(args, "verbosity", None))):
            return main(args)

    return run


def run_cli(
    main: Callable[[Any], Any], parse_args: Callable[[list[str] | None], Any], argv: list[str] | None = None,
    errors: tuple[type[BaseException], ...] = EXPECTED_ERRORS,
) -> int:
    """Parse ``argv`` (argparse's own usage errors exit with status 2) and run ``main`` at the
    level of ``--quiet`` / ``--verbose`` (the level from before is restored afterwards); return
    its status if it returns an int, else 0. An expected error, or a fault of the machine (disk
    full, out of memory, ...), is logged as ``error: <message>`` on stderr and returns 1 (a
    :class:`~moh_dit.errors.MoHDiTError` names its parameters by this command's flags);
    ``--debug`` lets it raise with its traceback instead."""
    args = parse_args(argv)
    flags = ArgumentParser.last_flags
    with verbosity(command_level(getattr(args, "verbosity", None))):
        try:
            status = main(args)
        except (*errors, OSError, MemoryError) as error:
            if getattr(args, "debug", False):
                raise
            if isinstance(error, MoHDiTError):
                message = error.for_command(flags)
            else:
                message = str(error) if isinstance(error, errors) else environment_fault(error)
            if message is None:
                raise  # a bug: keep the traceback
            logger.error("%s", message)
            return 1
    return status if isinstance(status, int) else 0
