"""`moh-dit extract-latents` from a clone: ``python scripts/extract_latents.py --help``."""
import sys

from moh_dit.commands import main

if __name__ == "__main__":
    sys.exit(main(["extract-latents", *sys.argv[1:]]))
