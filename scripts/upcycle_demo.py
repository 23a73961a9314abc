import sys
from moh_dit.commands import main
sys.exit(main(["upcycle-demo", *sys.argv[1:]]))
