"""`moh-dit convert` from a clone: ``python scripts/convert_checkpoint.py --help`` (the command lives in
``moh_dit/commands/convert_checkpoint.py``)."""

import sys

from moh_dit.commands.convert_checkpoint import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
