"""What a head-activation sweep produces and how it is written: one :class:`SweepRow` per
ratio, the :class:`SweepResult` with the settings, and :func:`write_sweep`'s three files
(``sweep.json``, ``sweep.csv`` and the ``fid_vs_ratio.png`` plot, drawn with matplotlib).

``moh_dit.sampling.sweep`` runs the sweep and re-exports everything here.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np
import PIL.Image

from ..utils.io import write_bytes_atomic, write_json_atomic
from ..utils.output_folders import write_output_marker

__all__ = [
    "JSON_FILE",
    "CSV_FILE",
    "PLOT_FILE",
    "CSV_COLUMNS",
    "PLOT_PANELS",
    "SweepRow",
    "SweepResult",
    "write_sweep",
    "is_sweep_folder",
    "plot_fid_vs_ratio",
    "figure_png",
]

PathLike = Union[str, os.PathLike]
JSON_FILE, CSV_FILE, PLOT_FILE = "sweep.json", "sweep.csv", "fid_vs_ratio.png"


@dataclass
class SweepRow:
    """Results at one head activation ratio.

    ``attention_flops_per_image``: ideal head-sparse attention FLOPs of all transformer
    calls that make one image (``transformer_calls_per_image`` forward passes); the dense
    count is the same model with every head active. ``sampling_seconds``: wall time of
    sampling (transformer, scheduler, decoding) for all ``num_samples`` images;
    ``evaluation_seconds``: the rest (feature extraction, metrics, PNG writing if asked).
    ``class_accuracy``: fraction of the images a classifier assigns to the class they were
    made for (None without a classifier), and per class in ``class_accuracy_per_class``.
    """

    ratio: str
    realised_ratio: float
    top_k_per_layer: list[int]
    fid: float | None
    sfid: float | None
    inception_score: float | None
    precision: float | None
    recall: float | None
    attention_flops_per_image: int
    dense_attention_flops_per_image: int
    attention_flop_ratio: float
    sampling_seconds: float
    evaluation_seconds: float
    num_samples: int
    requested: list[str] = field(default_factory=list)
    samples_dir: str | None = None
    class_accuracy: float | None = None
    class_accuracy_per_class: dict[str, float] | None = None

    @property
    def seconds_per_image(self) -> float:
        return self.sampling_seconds / self.num_samples


@dataclass
class SweepResult:
    """All rows (highest ratio first) and the settings that produced them."""

    rows: list[SweepRow]
    settings: dict[str, Any]

    @property
    def comparable_to_published(self) -> bool:
        return bool(self.settings.get("comparable_to_published"))

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "rows": [dataclasses.asdict(row) for row in self.rows]}

    def table(self) -> str:
        """A compact fixed-width table for the terminal (a class-accuracy column when measured)."""
        with_accuracy = any(row.class_accuracy is not None for row in self.rows)
        header = f"{'ratio':<14}{'realised':>9}{'FID':>9}{'sFID':>9}{'IS':>8}{'prec':>7}{'rec':>7}" \
                 + (f"{'class acc':>10}" if with_accuracy else "") \
                 + f"{'attn GFLOP/img':>16}{'vs dense':>9}{'s/img':>9}"
        lines = [header, "-" * len(header)]

        def num(value: float | None, width: int, digits: int) -> str:
            return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"

        for row in self.rows:
            lines.append(
                f"{row.ratio:<14}{row.realised_ratio:>9.4f}{num(row.fid, 9, 2)}{num(row.sfid, 9, 2)}"
                f"{num(row.inception_score, 8, 2)}{num(row.precision, 7, 3)}{num(row.recall, 7, 3)}"
                + (num(row.class_accuracy, 10, 3) if with_accuracy else "")
                + f"{row.attention_flops_per_image / 1e9:>16.3f}{row.attention_flop_ratio:>9.3f}"
                f"{row.seconds_per_image:>9.4f}"
            )
        lines.append(f"extractor: {self.settings.get('extractor')}"
                     + ("" if self.comparable_to_published else " (NOT comparable to published numbers)"))
        return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Output files
# --------------------------------------------------------------------------------------

CSV_COLUMNS = (
    "ratio", "realised_ratio", "fid", "sfid", "inception_score", "precision", "recall",
    "attention_flops_per_image", "dense_attention_flops_per_image", "attention_flop_ratio",
    "sampling_seconds", "seconds_per_image", "evaluation_seconds", "num_samples", "top_k_per_layer",
    "class_accuracy",
)


def _csv_text(rows: Sequence[SweepRow]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        values = {**dataclasses.asdict(row), "seconds_per_image": row.seconds_per_image,
                  "top_k_per_layer": " ".join(str(k) for k in row.top_k_per_layer)}
        writer.writerow(["" if values[c] is None else values[c] for c in CSV_COLUMNS])
    return buffer.getvalue()


def write_sweep(result: SweepResult, output_dir: PathLike) -> dict[str, Path]:
    """Write ``sweep.json`` (settings + rows), ``sweep.csv`` and ``fid_vs_ratio.png``, and the
    output marker that says ``moh-dit sweep`` wrote the folder.

    Everything is rendered in memory first and each file goes through a temporary name and
    ``os.replace``, so a failure leaves no partial file (an OSError, such as a full disk, names
    the file). Returns the paths.
    """
    output_dir = Path(output_dir)
    csv_text = _csv_text(result.rows)
    title, subtitle = _plot_titles(result.settings)
    png = figure_png(plot_fid_vs_ratio(result.rows, title, subtitle, comparable=result.comparable_to_published))
    output_dir.mkdir(parents=True, exist_ok=True)
    write_output_marker(output_dir, "sweep")
    paths = {"json": output_dir / JSON_FILE, "csv": output_dir / CSV_FILE, "plot": output_dir / PLOT_FILE}
    write_bytes_atomic(paths["csv"], csv_text.encode("utf-8"))
    write_bytes_atomic(paths["plot"], png)
    write_json_atomic(paths["json"], result.to_dict())  # last: its presence means the sweep is complete
    return paths


def is_sweep_folder(folder: Path) -> bool:
    """Whether ``folder`` is a sweep's output from before the output marker: it holds
    ``sweep.json``, or only what a sweep writes (its tables, plot and ``ratio_X`` folders)."""
    if (folder / JSON_FILE).is_file():
        return True
    names = [entry.name for entry in folder.iterdir()]
    return bool(names) and all(name in (CSV_FILE, PLOT_FILE) or re.fullmatch(r"ratio_\d\.\d{4}", name)
                               for name in names)


def _plot_titles(settings: dict[str, Any]) -> tuple[str, str]:
    model = Path(str(settings.get("model", ""))).name or "model"
    steps, cfg = settings.get("num_inference_steps"), settings.get("guidance_scale")
    title = f"{model}: FID-{settings.get('num_samples')} vs head activation ({steps} steps, cfg {cfg})"
    extractor = str(settings.get("extractor", "?"))
    if settings.get("comparable_to_published"):
        subtitle = "ADM-comparable: published TF Inception weights"
    elif "RANDOM" in extractor:
        seed = extractor.rsplit("seed=", 1)[-1] if "seed=" in extractor else "?"
        subtitle = f"random Inception (seed {seed}): NOT comparable to published numbers"
    else:
        subtitle = f"extractor {extractor}: NOT comparable to published numbers"
    return title, subtitle


# (SweepRow field, y-axis label) of each panel of fid_vs_ratio.png, left to right. Panels
# after the first are drawn only when some row has a value (class accuracy needs a classifier).
PLOT_PANELS: tuple[tuple[str, str], ...] = (("fid", "FID"), ("class_accuracy", "class accuracy of samples"))
PLOT_SIZE = (720, 460)  # pixels
_PLOT_DPI = 100
_LINE_COLOUR = "#1f5ab4"


def _figure_class():
    """matplotlib's Figure with the Agg canvas: no pyplot, no global backend switch, no display."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"the sweep plot needs matplotlib ({err}); pip install matplotlib") from None
    return Figure, FigureCanvasAgg


def plot_fid_vs_ratio(
    rows: Sequence[SweepRow], title: str, subtitle: str, comparable: bool, size: tuple[int, int] = PLOT_SIZE
):
    """FID against realised head activation ratio, as a matplotlib ``Figure`` (Agg canvas).

    One panel per ``PLOT_PANELS`` entry that has values (FID always): the rows' values against their realised ratio
    (rows without a value left out), points joined by a line, each labelled with its value
    (and its keyword, e.g. ``trained``). The subtitle names the extractor and is green when
    the numbers are comparable to published ones, red when not. ``size`` is in pixels.
    :func:`figure_png` renders it.
    """
    figure_class, canvas_class = _figure_class()
    figure = figure_class(figsize=(size[0] / _PLOT_DPI, size[1] / _PLOT_DPI), dpi=_PLOT_DPI)
    canvas_class(figure)
    figure.suptitle(title, x=0.02, y=0.98, ha="left", fontsize=11)
    figure.text(0.02, 0.905, subtitle, ha="left", fontsize=9, color="#146e14" if comparable else "#be1e1e")
    panels = [panel for i, panel in enumerate(PLOT_PANELS)
              if i == 0 or any(getattr(row, panel[0]) is not None for row in rows)]
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (field_name, label) in zip(axes, panels):
        _plot_panel(ax, rows, field_name, label)
    figure.subplots_adjust(left=0.1, right=0.97, top=0.84, bottom=0.13, wspace=0.3)
    return figure


def _plot_panel(ax, rows: Sequence[SweepRow], field_name: str, label: str) -> None:
    points = sorted((row.realised_ratio, getattr(row, field_name), row.ratio) for row in rows
                    if getattr(row, field_name) is not None)
    ax.set_xlabel("head activation ratio (realised)")
    ax.set_ylabel(label)
    ax.grid(True, color="#e1e1e1")
    if not points:
        ax.text(0.5, 0.5, f"no {label} values", ha="center", va="center", transform=ax.transAxes)
        return
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ax.plot(xs, ys, color=_LINE_COLOUR, linewidth=2, marker="o", markersize=6, markeredgecolor="white")
    for x, y, name in points:
        text = f"{y:.2f}" if _is_number(name) else f"{name}: {y:.2f}"
        ax.annotate(text, (x, y), xytext=(6, 6), textcoords="offset points", fontsize=8, color="#282828")
    ax.margins(x=0.12, y=0.15)


def figure_png(figure) -> bytes:
    """``figure`` as an RGB PNG of exactly its pixel size."""
    figure.canvas.draw()
    rgba = np.asarray(figure.canvas.buffer_rgba())  # (H, W, 4) uint8
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.ascontiguousarray(rgba[..., :3])).save(buffer, format="PNG")
    return buffer.getvalue()


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
