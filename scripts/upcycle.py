"""`moh-dit upcycle` from a clone: ``python scripts/upcycle.py --help`` (the command lives in
``moh_dit/commands/upcycle.py``)."""

import sys

from moh_dit.commands.upcycle import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
