import sys
from moh_dit.commands import main
sys.exit(main(["upcycle", *sys.argv[1:]]))
