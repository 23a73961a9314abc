"""``python -m moh_dit.commands COMMAND [flags]`` (what ``accelerate launch -m`` runs)."""
import sys

from . import main

sys.exit(main())
