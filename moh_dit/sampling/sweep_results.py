"""What a head-activation sweep produces and how it is written: one :class:`SweepRow` per
ratio or schedule, the :class:`SweepResult` with the settings, and :func:`write_sweep`'s three
files (``sweep.json``, ``sweep.csv`` and the ``fid_vs_ratio.png`` plot, drawn with matplotlib).

The plot puts every row at its mean attention FLOPs relative to dense (the cost axis on which
a schedule and a constant ratio can be compared), constant ratios joined by a line and each
schedule its own marker, with the rows' 95% intervals as error bars; FID is drawn from 0 and
class accuracy on [0, 1], so that differences smaller than the intervals do not look like a
trend. ``write_sweep`` renders everything before it writes; further figures can be added to its
``extra_files`` (name -> bytes) by a caller.

``moh_dit.sampling.sweep`` runs the sweep and re-exports everything here.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np

from ..utils.figures import figure_png, new_figure
from ..utils.io import write_bytes_atomic, write_json_atomic
from ..utils.output_folders import write_output_marker

__all__ = [
    "INTERVAL_NOTE",
    "JSON_FILE",
    "CSV_FILE",
    "PLOT_FILE",
    "CSV_COLUMNS",
    "PLOT_PANELS",
    "SweepRow",
    "SweepResult",
    "write_sweep",
    "is_sweep_folder",
    "model_name",
    "plot_fid_vs_ratio",
    "figure_png",
]

PathLike = Union[str, os.PathLike]
JSON_FILE, CSV_FILE, PLOT_FILE = "sweep.json", "sweep.csv", "fid_vs_ratio.png"
INTERVAL_NOTE = ("95% intervals: fid_low/fid_high from a bootstrap of the samples' features against the fixed "
                 "reference statistics (2.5/97.5 percentiles, shifted by the bootstrap's bias fid_bootstrap_bias); "
                 "class_accuracy_low/high the Wilson score interval")


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

    ``mean_attention_flops``: ideal head-sparse attention FLOPs of one forward pass for one image,
    averaged over the steps; ``attention_flop_ratio`` is the same mean relative to dense. A
    schedule's row has its ``schedule`` spec, the mean realised ratio as ``realised_ratio``, every
    step's realised ratio and top-K (``head_activation_ratios``, ``top_k_per_step``; its
    ``top_k_per_layer`` is empty) and, with FLOP matching, the label of the constant row of
    closest FLOPs (``matched_constant``). ``fid_low``/``fid_high`` and ``class_accuracy_low``/
    ``class_accuracy_high`` are 95% intervals (``INTERVAL_NOTE``).
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
    mean_attention_flops: float | None = None
    schedule: str | None = None
    head_activation_ratios: list[float] | None = None
    top_k_per_step: list[list[int]] | None = None
    matched_constant: str | None = None
    fid_low: float | None = None
    fid_high: float | None = None
    fid_bootstrap_bias: float | None = None
    class_accuracy_low: float | None = None
    class_accuracy_high: float | None = None

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
        """A compact fixed-width table for the terminal: a class-accuracy column when measured, 95%
        interval columns when computed, and a line per FLOP-matched schedule."""
        rows = self.rows
        with_accuracy = any(row.class_accuracy is not None for row in rows)
        fid_ci = any(row.fid_low is not None for row in rows)
        accuracy_ci = any(row.class_accuracy_low is not None for row in rows)
        width = max([14] + [len(row.ratio) + 2 for row in rows])
        header = f"{'ratio':<{width}}{'realised':>9}{'FID':>9}" + (f"{'FID 95%':>17}" if fid_ci else "") \
            + f"{'sFID':>9}{'IS':>8}{'prec':>7}{'rec':>7}" + (f"{'class acc':>10}" if with_accuracy else "") \
            + (f"{'acc 95%':>17}" if accuracy_ci else "") + f"{'attn GFLOP/img':>16}{'vs dense':>9}{'s/img':>9}"
        lines = [header, "-" * len(header)]

        def num(value: float | None, width: int, digits: int) -> str:
            return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"

        def interval(low: float | None, high: float | None, digits: int) -> str:
            return f"{'-':>17}" if low is None else f"{f'[{low:.{digits}f}, {high:.{digits}f}]':>17}"

        for row in rows:
            lines.append(
                f"{row.ratio:<{width}}{row.realised_ratio:>9.4f}{num(row.fid, 9, 2)}"
                + (interval(row.fid_low, row.fid_high, 2) if fid_ci else "")
                + f"{num(row.sfid, 9, 2)}{num(row.inception_score, 8, 2)}{num(row.precision, 7, 3)}{num(row.recall, 7, 3)}"
                + (num(row.class_accuracy, 10, 3) if with_accuracy else "")
                + (interval(row.class_accuracy_low, row.class_accuracy_high, 3) if accuracy_ci else "")
                + f"{row.attention_flops_per_image / 1e9:>16.3f}{row.attention_flop_ratio:>9.3f}"
                f"{row.seconds_per_image:>9.4f}"
            )
        by_label = {row.ratio: row for row in rows}
        for row in rows:
            matched = by_label.get(row.matched_constant or "")
            if matched is not None:
                lines.append(f"{row.ratio} vs the constant ratio of closest attention FLOPs, {matched.ratio} "
                             f"({matched.realised_ratio:.4f}): FLOPs x{row.attention_flop_ratio / matched.attention_flop_ratio:.4f}")
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
    "class_accuracy", "fid_low", "fid_high", "class_accuracy_low", "class_accuracy_high", "schedule",
    "mean_attention_flops", "matched_constant",
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


def write_sweep(result: SweepResult, output_dir: PathLike, extra_files: dict[str, bytes] | None = None
                ) -> dict[str, Path]:
    """Write ``sweep.json`` (settings + rows), ``sweep.csv`` and ``fid_vs_ratio.png``, and the
    output marker that says ``moh-dit sweep`` wrote the folder.

    ``extra_files`` (file name -> bytes, e.g. another figure rendered from the result) are
    written beside them, returned under their names. Everything is rendered in memory first
    and each file goes through a temporary name and ``os.replace``, so a failure leaves no
    partial file (an OSError, such as a full disk, names the file). Returns the paths.
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
    for name, data in (extra_files or {}).items():
        paths[name] = output_dir / name
        write_bytes_atomic(paths[name], data)
    write_json_atomic(paths["json"], result.to_dict())  # last: its presence means the sweep is complete
    return paths


def is_sweep_folder(folder: Path) -> bool:
    """Whether ``folder`` is a sweep's output from before the output marker: it holds
    ``sweep.json``, or only what a sweep writes (its tables, plot and ``ratio_X`` folders)."""
    if (folder / JSON_FILE).is_file():
        return True
    names = [entry.name for entry in folder.iterdir()]
    return bool(names) and all(name in (CSV_FILE, PLOT_FILE) or re.fullmatch(r"ratio_\d\.\d{4}(_[A-Za-z0-9._]+)?", name)
                               for name in names)


# Folder names that say where a model sits, not what it is: the title names the folder above too.
_GENERIC_FOLDERS = ("final", "transformer", "ema", "model")


def model_name(model: str | os.PathLike) -> str:
    """A model's name for titles: its model card's title (``README.md``) or its run's preset
    (``train_config.json``), with the folder (and, for ``final``, ``transformer`` or a
    ``checkpoint-N``, the folder above it): ``"MoH-DiT-Tiny/2 (run/final)"``."""
    path = Path(str(model))
    label = path.name or str(model)
    if path.name in _GENERIC_FOLDERS or path.name.startswith("checkpoint-"):
        label = f"{path.parent.name}/{path.name}"
    name = None
    for folder in (path, path.parent):
        name = name or _card_title(folder / "README.md") or _run_preset(folder / "train_config.json")
    return f"{name} ({label})" if name and name != label else label


def _card_title(card: Path) -> str | None:
    try:
        with open(card, encoding="utf-8") as f:
            head = f.read(8192)
    except (OSError, UnicodeDecodeError):
        return None
    return next((line[2:].strip() for line in head.splitlines() if line.startswith("# ")), None)


def _run_preset(config: Path) -> str | None:
    try:
        preset = json.loads(config.read_text(encoding="utf-8")).get("preset")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return preset if isinstance(preset, str) else None


def _plot_titles(settings: dict[str, Any]) -> tuple[str, str]:
    model = settings.get("model_name") or model_name(str(settings.get("model", ""))) or "model"
    steps, cfg = settings.get("num_inference_steps"), settings.get("guidance_scale")
    title = f"{model}: {settings.get('num_samples')} samples per row ({steps} steps, cfg {cfg})"
    extractor = str(settings.get("extractor", "?"))
    if settings.get("comparable_to_published"):
        subtitle = "ADM-comparable: published TF Inception weights"
    elif "RANDOM" in extractor:
        seed = extractor.rsplit("seed=", 1)[-1] if "seed=" in extractor else "?"
        subtitle = f"random Inception (seed {seed}): NOT comparable to published numbers"
    else:
        subtitle = f"extractor {extractor}: NOT comparable to published numbers"
    if settings.get("bootstrap_resamples"):
        subtitle += f"\nbars: 95% intervals (FID: bootstrap, {settings['bootstrap_resamples']} resamples; class " \
                    "accuracy: Wilson)"
    return title, subtitle


# (SweepRow field, y-axis label) of each panel of fid_vs_ratio.png, left to right. Panels
# after the first are drawn only when some row has a value (class accuracy needs a classifier).
PLOT_PANELS: tuple[tuple[str, str], ...] = (("fid", "FID"), ("class_accuracy", "class accuracy of samples"))
PLOT_SIZE = (900, 520)  # pixels
_PLOT_DPI = 100
_LINE_COLOUR = "#1f5ab4"
# One marker and colour per schedule, in row order.
_SCHEDULE_STYLES = (("s", "#d2691e"), ("^", "#2e8b57"), ("D", "#8b3a8b"), ("v", "#b22222"), ("P", "#008b8b"),
                    ("X", "#6b6b00"))
X_LABEL = "attention FLOPs / dense (mean over the steps)"
CONSTANT_LABEL = "constant ratio"


def plot_fid_vs_ratio(
    rows: Sequence[SweepRow], title: str, subtitle: str, comparable: bool, size: tuple[int, int] = PLOT_SIZE
):
    """FID (and class accuracy) against mean relative attention FLOPs, as a matplotlib ``Figure`` (Agg canvas).

    One panel per ``PLOT_PANELS`` entry that has values (FID always). In each, the constant-ratio
    rows are joined by a line (label ``CONSTANT_LABEL``; the trained ratio drawn as a star),
    every schedule row is a marker of its own (labelled with its spec; schedules at the FLOPs of
    an earlier-drawn point are drawn side by side, shifted by 1.5% of the axis each, so that
    none hides another), and rows with a 95% interval get an error bar. FID is drawn from 0 and class accuracy on [0, 1]; a top axis
    gives the constant ratios' head activation ratio. The subtitle names the extractor and is
    green when the numbers are comparable to published ones, red when not. ``size`` is in
    pixels. :func:`figure_png` renders it.
    """
    figure = new_figure(size[0] / _PLOT_DPI, size[1] / _PLOT_DPI, _PLOT_DPI)
    figure.suptitle(title, x=0.02, y=0.98, ha="left", fontsize=11)
    figure.text(0.02, 0.935, subtitle, ha="left", va="top", fontsize=9, color="#146e14" if comparable else "#be1e1e")
    panels = [panel for i, panel in enumerate(PLOT_PANELS)
              if i == 0 or any(getattr(row, panel[0]) is not None for row in rows)]
    axes = figure.subplots(1, len(panels), squeeze=False, sharex=True)[0]
    for ax, (field_name, label) in zip(axes, panels):
        _plot_panel(ax, rows, field_name, label)
    if any(ax.get_legend_handles_labels()[0] for ax in axes):
        axes[0].legend(loc="best", fontsize=8, framealpha=0.85)
    figure.subplots_adjust(left=0.08, right=0.98, top=0.76, bottom=0.11, wspace=0.25)
    return figure


def _error(row: SweepRow, field_name: str, value: float) -> tuple[float, float] | None:
    """(below, above) ``value`` of the row's 95% interval for ``field_name``; None without one."""
    low, high = getattr(row, f"{field_name}_low", None), getattr(row, f"{field_name}_high", None)
    if low is None or high is None:
        return None
    return max(0.0, value - low), max(0.0, high - value)


def _draw(ax, points: list[tuple[float, float, tuple[float, float] | None]], **style) -> None:
    """Points (x, y, error or None) with error bars where there is an interval, in one style."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    errors = [p[2] or (0.0, 0.0) for p in points]
    yerr = None if all(p[2] is None for p in points) else [[e[0] for e in errors], [e[1] for e in errors]]
    ax.errorbar(xs, ys, yerr=yerr, capsize=3, elinewidth=1, markeredgecolor="white", **style)


def _plot_panel(ax, rows: Sequence[SweepRow], field_name: str, label: str) -> None:
    measured = [row for row in rows if getattr(row, field_name) is not None]
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel(label)
    ax.grid(True, color="#e1e1e1")
    if not measured:
        ax.text(0.5, 0.5, f"no {label} values", ha="center", va="center", transform=ax.transAxes)
        return

    def point(row: SweepRow) -> tuple[float, float, tuple[float, float] | None]:
        value = getattr(row, field_name)
        return row.attention_flop_ratio, value, _error(row, field_name, value)

    constants = sorted((row for row in measured if row.schedule is None), key=lambda row: row.attention_flop_ratio)
    if constants:
        _draw(ax, [point(row) for row in constants], color=_LINE_COLOUR, linewidth=2, marker="o", markersize=6,
              label=CONSTANT_LABEL)
        trained = [point(row) for row in constants if "trained" in row.requested]
        if trained:
            ax.plot([trained[0][0]], [trained[0][1]], linestyle="none", marker="*", markersize=14, color=_LINE_COLOUR,
                    markeredgecolor="white", label="trained ratio", zorder=3)
    xs = [row.attention_flop_ratio for row in measured]
    shift = 0.015 * max(max(xs) - min(xs), 0.05)
    taken = [row.attention_flop_ratio for row in constants]
    for i, row in enumerate(row for row in measured if row.schedule is not None):
        marker, colour = _SCHEDULE_STYLES[i % len(_SCHEDULE_STYLES)]
        x, y, error = point(row)
        dodge = sum(abs(x - other) < 1e-9 for other in taken) * shift  # side by side with equal-FLOP points
        taken.append(x)
        _draw(ax, [(x + dodge, y, error)], linestyle="none", marker=marker, markersize=8, color=colour,
              label=row.schedule)
    tops = [p[1] + (p[2] or (0, 0))[1] for p in map(point, measured)]
    if field_name == "class_accuracy":
        ax.set_ylim(0.0, 1.02)
    else:
        ax.set_ylim(0.0, max(tops) * 1.15 if max(tops) > 0 else 1.0)
    ax.margins(x=0.08)
    _ratio_axis(ax, constants)


def _ratio_axis(ax, constants: Sequence[SweepRow]) -> None:
    """A top axis reading the head activation ratio of the constant rows off the FLOPs axis
    (interpolated between them), when there are two or more."""
    pairs = sorted({(row.attention_flop_ratio, row.realised_ratio) for row in constants})
    if len(pairs) < 2 or len({x for x, _ in pairs}) < len(pairs):
        return
    flop, ratio = np.array([x for x, _ in pairs]), np.array([r for _, r in pairs])
    top = ax.secondary_xaxis("top", functions=(lambda x: _interpolate(x, flop, ratio), lambda r: _interpolate(r, ratio, flop)))
    top.set_xlabel("head activation ratio (constant)", fontsize=8)
    top.tick_params(labelsize=8)


def _interpolate(x, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """Piecewise-linear through (xp, fp), continued along the end segments (``np.interp`` would
    hold the end values, which puts every tick beyond the ends at the axis' edge)."""
    x = np.asarray(x, dtype=float)
    low = fp[0] + (x - xp[0]) * (fp[1] - fp[0]) / (xp[1] - xp[0])
    high = fp[-1] + (x - xp[-1]) * (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
    return np.where(x < xp[0], low, np.where(x > xp[-1], high, np.interp(x, xp, fp)))


