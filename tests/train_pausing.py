"""``moh-dit train`` for tests/test_train_distributed.py: the same command line, except that every
process stops (sleeping, alive) right after the checkpoint of step ``$MOH_DIT_TEST_PAUSE_AFTER``
(0: never), a run the test then finds busy and kills. Each process writes its pid to
``$MOH_DIT_TEST_PID_DIR/<rank>`` (torchrun puts its workers in sessions of their own)."""

import os
import sys
import time
from pathlib import Path

from moh_dit.commands import run
from moh_dit.training import Checkpoint

PAUSE_AFTER = int(os.environ.get("MOH_DIT_TEST_PAUSE_AFTER", "0"))
_save = Checkpoint.save


def _save_then_pause(self, step, *args, **kwargs):
    path = _save(self, step, *args, **kwargs)
    if step == PAUSE_AFTER:
        parent = os.getppid()
        while os.getppid() == parent:  # killed by the test; gone by itself if the launcher is
            time.sleep(0.2)
        os._exit(1)
    return path


if __name__ == "__main__":
    Checkpoint.save = _save_then_pause
    if os.environ.get("MOH_DIT_TEST_PID_DIR"):
        (Path(os.environ["MOH_DIT_TEST_PID_DIR"]) / os.environ.get("RANK", "0")).write_text(str(os.getpid()))
    sys.exit(run("train", sys.argv[1:]))
