"""`moh-dit train-classifier` from a clone: ``python scripts/train_classifier.py --help``."""
import sys

from moh_dit.commands import main

if __name__ == "__main__":
    sys.exit(main(["train-classifier", *sys.argv[1:]]))
