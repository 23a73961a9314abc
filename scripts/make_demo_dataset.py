"""`moh-dit make-demo-dataset` from a clone: ``python scripts/make_demo_dataset.py --help``."""
import sys

from moh_dit.commands import main

if __name__ == "__main__":
    sys.exit(main(["make-demo-dataset", *sys.argv[1:]]))
