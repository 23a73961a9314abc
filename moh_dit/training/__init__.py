"""Training: :class:`TrainConfig` and :func:`train` (``trainer.py``), the checkpoint folders
(``checkpoint.py``)."""

from pathlib import Path

from .checkpoint import Checkpoint
from .trainer import RUN_RECORD, TrainConfig, compile_model, train, update_ema

__all__ = ["TrainConfig", "train", "Checkpoint", "RUN_RECORD", "compile_model", "update_ema", "find_latest_checkpoint"]


def find_latest_checkpoint(output_dir) -> Path | None:
    """The newest ``checkpoints/step-N`` folder of a run, or None."""
    return Checkpoint(output_dir).latest()
