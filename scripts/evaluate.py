"""`moh-dit evaluate` from a clone: ``python scripts/evaluate.py --help`` (the command lives in
``moh_dit/commands/evaluate.py``)."""

import sys

from moh_dit.commands.evaluate import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
