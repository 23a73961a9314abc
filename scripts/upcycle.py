"""`moh-dit upcycle` from a clone: ``python scripts/upcycle.py --help``."""
import sys

from moh_dit.commands import main

if __name__ == "__main__":
    sys.exit(main(["upcycle", *sys.argv[1:]]))
