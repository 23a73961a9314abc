"""`moh-dit sweep` from a clone: ``python scripts/sweep_head_ratio.py --help`` (the command lives in
``moh_dit/commands/sweep_head_ratio.py``)."""

import sys

from moh_dit.commands.sweep_head_ratio import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
