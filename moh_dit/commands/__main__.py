"""``python -m moh_dit.commands <command> [flags]``: the ``moh-dit`` command without its script."""

import sys

from . import main

sys.exit(main())
