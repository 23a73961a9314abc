"""`moh-dit plot-head-usage` from a clone: ``python scripts/plot_head_usage.py --help``."""
import sys

from moh_dit.commands import main

if __name__ == "__main__":
    sys.exit(main(["plot-head-usage", *sys.argv[1:]]))
