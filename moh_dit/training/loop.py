"""The step loop's public helpers under their earlier import path; the loop itself is part
of :func:`moh_dit.training.train` (``trainer.py``)."""

from .trainer import sample_grid, update_ema

__all__ = ["sample_grid", "update_ema"]
