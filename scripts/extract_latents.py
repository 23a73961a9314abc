"""`moh-dit extract-latents` from a clone: ``python scripts/extract_latents.py --help`` (the command lives in
``moh_dit/commands/extract_latents.py``)."""

import sys

from moh_dit.commands.extract_latents import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
