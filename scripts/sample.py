"""`moh-dit sample` from a clone: ``python scripts/sample.py --help`` (the command lives in
``moh_dit/commands/sample.py``)."""

import sys

from moh_dit.commands.sample import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
