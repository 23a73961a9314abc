"""`moh-dit export` from a clone: ``python scripts/export_pipeline.py --help`` (the command lives in
``moh_dit/commands/export_pipeline.py``)."""

import sys

from moh_dit.commands.export_pipeline import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
