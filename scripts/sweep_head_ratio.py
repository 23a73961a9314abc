"""`moh-dit sweep` from a clone: ``python scripts/sweep_head_ratio.py --help``."""
import sys

from moh_dit.commands import main

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
