"""`moh-dit upcycle-demo` from a clone: ``python scripts/upcycle_demo.py --help`` (the command lives in
``moh_dit/commands/upcycle_demo.py``)."""

import sys

from moh_dit.commands.upcycle_demo import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
