"""`moh-dit sample` from a clone: ``python scripts/sample.py --help``."""
import sys

from moh_dit.commands import main

if __name__ == "__main__":
    sys.exit(main(["sample", *sys.argv[1:]]))
