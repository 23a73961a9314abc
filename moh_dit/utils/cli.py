"""The scripts' common entry point: expected errors become one line, not a traceback."""

from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["run_cli"]

# Errors that mean bad input or a bad environment, which the message explains; anything
# else is a bug and keeps its traceback.
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FileExistsError)


def run_cli(
    main: Callable[[Any], Any], parse_args: Callable[[list[str] | None], Any], argv: list[str] | None = None,
    errors: tuple[type[BaseException], ...] = EXPECTED_ERRORS,
) -> int:
    """Parse ``argv`` (argparse's own usage errors exit with status 2) and run ``main``;
    return its status if it returns an int, else 0. An expected error prints
    ``error: <message>`` on stderr and returns 1."""
    args = parse_args(argv)
    try:
        status = main(args)
    except errors as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return status if isinstance(status, int) else 0
