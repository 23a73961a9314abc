"""`moh-dit train-classifier` from a clone: ``python scripts/train_classifier.py --help`` (the command lives in
``moh_dit/commands/train_classifier.py``)."""

import sys

from moh_dit.commands.train_classifier import cli, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
