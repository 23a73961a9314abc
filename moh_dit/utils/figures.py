"""Figures without pyplot: matplotlib's ``Figure`` on the Agg canvas (no global backend switch,
no display), and its pixels. The head-usage figure, the sweep's plot and the training run's
figure are drawn this way."""

from __future__ import annotations

import io

import numpy as np
import PIL.Image
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["new_figure", "figure_rgb", "figure_png"]


def new_figure(width: float, height: float, dpi: float) -> Figure:
    """A ``width`` x ``height`` inch figure at ``dpi``, attached to an Agg canvas."""
    figure = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(figure)
    return figure


def figure_rgb(figure: Figure) -> np.ndarray:
    """``figure`` drawn: (H, W, 3) uint8, exactly its pixel size."""
    figure.canvas.draw()
    return np.ascontiguousarray(np.asarray(figure.canvas.buffer_rgba())[..., :3])


def figure_png(figure: Figure) -> bytes:
    """``figure`` as an RGB PNG of exactly its pixel size."""
    buffer = io.BytesIO()
    PIL.Image.fromarray(figure_rgb(figure)).save(buffer, format="PNG")
    return buffer.getvalue()
