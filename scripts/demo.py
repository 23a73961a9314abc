"""`moh-dit demo` from a clone: ``python scripts/demo.py --help`` (the command lives in
``moh_dit/commands/demo.py``)."""

import sys

from moh_dit.commands.demo import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
