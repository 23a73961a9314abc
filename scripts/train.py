"""`moh-dit train` from a clone: ``python scripts/train.py --help`` (the command lives in
``moh_dit/commands/train.py``)."""

import sys

from moh_dit.commands.train import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
