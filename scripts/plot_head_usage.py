"""`moh-dit plot-head-usage` from a clone: ``python scripts/plot_head_usage.py --help`` (the command lives in
``moh_dit/commands/plot_head_usage.py``)."""

import sys

from moh_dit.commands.plot_head_usage import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
