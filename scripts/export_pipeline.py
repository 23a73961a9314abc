import sys
from moh_dit.commands import main
sys.exit(main(["export", *sys.argv[1:]]))
