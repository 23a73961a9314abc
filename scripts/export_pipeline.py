"""`moh-dit export` from a clone: ``python scripts/export_pipeline.py --help``."""
import sys

from moh_dit.commands import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
