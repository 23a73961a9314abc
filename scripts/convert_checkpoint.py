"""`moh-dit convert` from a clone: ``python scripts/convert_checkpoint.py --help``."""
import sys

from moh_dit.commands import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
