import sys
from moh_dit.commands import main
sys.exit(main(["app", *sys.argv[1:]]))
