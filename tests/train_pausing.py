"""``scripts/train.py`` for tests/test_train_distributed.py: the same command line, except
that every process stops (sleeping, alive) right after the checkpoint of step
``$MOH_DIT_TEST_PAUSE_AFTER`` -- a run that the test then finds busy, and kills. Each
process writes its pid to ``$MOH_DIT_TEST_PID_DIR/<rank>`` (torchrun puts its workers in
sessions of their own, so killing the launcher's process group does not reach them)."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import moh_dit.training.trainer as trainer

PAUSE_AFTER = int(os.environ.get("MOH_DIT_TEST_PAUSE_AFTER", "0"))
_real_save = trainer.save_checkpoint


def _save_then_pause(parts, cfg, step, run):
    path = _real_save(parts, cfg, step, run)
    if step == PAUSE_AFTER:
        parent = os.getppid()
        while os.getppid() == parent:  # killed by the test; gone by itself if the launcher is
            time.sleep(0.2)
        os._exit(1)
    return path


trainer.save_checkpoint = _save_then_pause  # where the step loop looks it up

if __name__ == "__main__":
    pid_dir = os.environ.get("MOH_DIT_TEST_PID_DIR")
    if pid_dir:
        (Path(pid_dir) / os.environ.get("RANK", "0")).write_text(str(os.getpid()))
    script = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
    spec = importlib.util.spec_from_file_location("train_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.exit(module.cli(sys.argv[1:]))
