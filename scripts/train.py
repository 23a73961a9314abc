"""`moh-dit train` from a clone: ``python scripts/train.py --help``."""
import sys

from moh_dit.commands import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
