"""`moh-dit evaluate` from a clone: ``python scripts/evaluate.py --help``."""
import sys

from moh_dit.commands import main

if __name__ == "__main__":
    sys.exit(main(["evaluate", *sys.argv[1:]]))
