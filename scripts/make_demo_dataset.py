"""`moh-dit make-demo-dataset` from a clone: ``python scripts/make_demo_dataset.py --help`` (the command lives in
``moh_dit/commands/make_demo_dataset.py``)."""

import sys

from moh_dit.commands.make_demo_dataset import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
