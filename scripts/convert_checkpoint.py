import sys
from moh_dit.commands import main
sys.exit(main(["convert", *sys.argv[1:]]))
