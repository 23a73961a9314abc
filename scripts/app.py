"""`moh-dit app` from a clone: ``python scripts/app.py --help`` (the command lives in
``moh_dit/commands/app.py``)."""

import sys

from moh_dit.commands.app import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
