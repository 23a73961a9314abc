import sys
from moh_dit.commands import main
sys.exit(main(["demo", *sys.argv[1:]]))
