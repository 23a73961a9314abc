"""The ``moh-dit`` command line: ``moh-dit COMMAND [flags]``, one module here per command.

A command module defines ``DESCRIPTION`` (one line), ``build_parser(parser)`` (its arguments,
named after the library's keywords) and ``main(args)`` (the job; torch and friends are imported
inside it, so ``--help`` stays fast). This module adds the common flags and runs ``main`` under
the one error handler: an error is one line ``error: <message>`` on stderr and exit status 1
(``--debug`` shows the traceback instead); argparse's own errors exit with 2, Ctrl-C with 130.
``moh-dit``, ``python -m moh_dit.commands`` (what ``accelerate launch -m`` runs) and
``python scripts/NAME.py`` all come here.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import sys

__all__ = ["COMMANDS", "build_parser", "float_range", "int_range", "main", "message", "run"]


def int_range(low: int, high: int | None = None):
    """An argparse type: an int in [low, high]."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}" if high is not None
                                             else f"must be >= {low}, got {value}")
        return value
    parse.__name__ = "int"  # argparse names the type in "invalid int value"
    return parse


def float_range(low: float, high: float | None = None, *, above: bool = False):
    """An argparse type: a finite float >= low (> low with ``above``) and < high."""
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < low or (above and value == low) or (high is not None and value >= high):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {low}"
                                             + (f" and < {high}" if high is not None else "") + f", got {text}")
        return value
    parse.__name__ = "float"
    return parse


# command -> its module in this package
COMMANDS = {
    "train": "train",
    "sample": "sample",
    "evaluate": "evaluate",
    "sweep": "sweep_head_ratio",
    "convert": "convert_checkpoint",
    "upcycle": "upcycle",
    "export": "export_pipeline",
    "extract-latents": "extract_latents",
    "train-classifier": "train_classifier",
    "make-demo-dataset": "make_demo_dataset",
    "demo": "demo",
    "upcycle-demo": "upcycle_demo",
    "plot-head-usage": "plot_head_usage",
    "app": "app",
}


def _module(name: str):
    return importlib.import_module(f"{__name__}.{COMMANDS[name]}")


def build_parser(name: str) -> argparse.ArgumentParser:
    """The parser of ``moh-dit NAME``: the command's own arguments, then the common flags."""
    module = _module(name)
    parser = argparse.ArgumentParser(prog=f"moh-dit {name}", description=module.DESCRIPTION)
    module.build_parser(parser)
    common = parser.add_argument_group("common flags")
    common.add_argument("--debug", action="store_true", default=False,
                        help="on an error, show the traceback instead of one line")
    level = common.add_mutually_exclusive_group()
    level.add_argument("-q", "--quiet", dest="log_level", action="store_const", const=logging.WARNING,
                       default=logging.INFO, help="print only warnings and errors")
    level.add_argument("-v", "--verbose", dest="log_level", action="store_const", const=logging.DEBUG,
                       help="also print debug messages")
    return parser


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: moh-dit COMMAND [flags]   (moh-dit COMMAND --help for its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {_module(name).DESCRIPTION}" for name in COMMANDS]
    return "\n".join(lines)


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"{record.levelname.lower()}: {text}" if record.levelno >= logging.WARNING else text


def message(error: BaseException) -> str:
    """``error`` in one line; an OSError names its file (``strerror: filename``)."""
    if isinstance(error, OSError) and error.filename is not None:
        files = " -> ".join(str(f) for f in (error.filename, error.filename2) if f is not None)
        text = f"{error.strerror or error}: {files}"
    else:
        text = str(error)
        if not isinstance(error, (ValueError, OSError, RuntimeError)) or not text:
            text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return " ".join(text.split())


def run(name: str, argv: list[str] | None = None) -> int:
    """Run ``moh-dit NAME`` with ``argv`` (default: the process's arguments); its exit status."""
    args = build_parser(name).parse_args(argv)
    # The library logs through ``logging.getLogger(__name__)``: a command shows its progress.
    logger = logging.getLogger("moh_dit")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Format("%(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(args.log_level)
    logger.propagate = False
    if args.log_level > logging.INFO:  # --quiet: no progress bars either (read when tqdm is imported)
        os.environ.update(TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    try:
        _module(name).main(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if args.debug:
            raise
        print(f"error: {message(error)}", file=sys.stderr)
        return 1
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    return 0


def main(argv: list[str] | None = None) -> int:
    """``moh-dit COMMAND [flags]``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from moh_dit import __version__

        print(f"moh-dit {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"moh-dit: error: unknown command {argv[0]!r} (moh-dit --help lists them)", file=sys.stderr)
        return 2
    return run(argv[0], argv[1:])
