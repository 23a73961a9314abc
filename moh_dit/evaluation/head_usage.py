"""Which attention heads a MoH-DiT uses: measured while sampling, or read from a training log,
and drawn as the paper's head-usage figures.

The load of a head is the fraction of tokens that use it: 1 for a shared head (always on),
on average ``K / routed`` for a routed head of a layer with top-K ``K``. A
:class:`HeadUsage` holds it per layer and head in three views: ``overall``, ``per_class`` and
``per_timestep`` (ranges of diffusion timesteps, or of training steps for a training log).

- :func:`measure_head_usage` samples a few images per class with a ``MoHDiTPipeline`` and
  records every transformer call through a forward hook: one pipeline call per class, so each
  class's usage is exactly that of its own images.
- :func:`head_usage_from_log` reads a run's ``head_usage.jsonl`` (what training writes each
  time it logs).
- :func:`plot_head_usage` draws the views as heatmaps (layers as rows, heads as columns, shared
  heads hatched left of a black line) on matplotlib's Agg canvas, without pyplot;
  :func:`write_head_usage` writes ``head_usage.png`` and ``head_usage.json`` (the plotted numbers).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from ..models.head_activation import preview_head_activation
from ..utils.figures import figure_png, figure_rgb, new_figure
from ..utils.io import write_bytes_atomic, write_json_atomic
from ..utils.logging import info_enabled

__all__ = ["HeadUsage", "JSON_FILE", "MAX_DEFAULT_CLASSES", "default_classes", "PLOT_FILE", "TIMESTEP", "TRAINING_STEP", "figure_png", "head_usage_from_log",
           "head_usage_figure_for_tracker", "measure_head_usage", "plot_head_usage", "write_head_usage"]

PLOT_FILE, JSON_FILE = "head_usage.png", "head_usage.json"
TIMESTEP, TRAINING_STEP = "timestep", "training step"  # what the ranges of ``per_timestep`` are ranges of
_TOLERANCE = 1e-6  # float32 fractions may pass 1 by a rounding error

Usage = list[list[float]]  # per layer, the load of each of its heads (layers may have different head counts)


def _check_usage(values: Any, heads: Sequence[int] | None, what: str) -> Usage:
    """``values`` as a list (layers) of lists (heads) of floats in [0, 1]; ``heads``, when
    given, is the number of heads each layer must have. ValueError naming ``what`` otherwise."""
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{what} must be a non-empty list of layers (lists of per-head loads); got {type(values).__name__}.")
    rows = []
    for layer, row in enumerate(values):
        if not isinstance(row, (list, tuple)) or not row:
            raise ValueError(f"{what}, layer {layer}: a non-empty list of per-head loads is needed.")
        try:
            floats = [float(v) for v in row]
        except (TypeError, ValueError):
            raise ValueError(f"{what}, layer {layer}: the loads must be numbers; got {row!r:.80}.") from None
        if not all(math.isfinite(v) and -_TOLERANCE <= v <= 1 + _TOLERANCE for v in floats):
            raise ValueError(f"{what}, layer {layer}: a load outside [0, 1] ({row!r:.80}); these are fractions of tokens.")
        rows.append([min(max(v, 0.0), 1.0) for v in floats])
    if heads is not None and [len(r) for r in rows] != list(heads):
        raise ValueError(f"{what} has {[len(r) for r in rows]} heads per layer; the layout has {list(heads)}.")
    return rows


def _mean(usages: Sequence[Usage]) -> Usage:
    """The per-head mean of several measurements of the same layout."""
    return [np.mean([u[layer] for u in usages], axis=0, dtype=np.float64).tolist() for layer in range(len(usages[0]))]


@dataclass
class HeadUsage:
    """Head loads of one model, per layer and head, in three views.

    ``overall``: over everything measured. ``per_class``: class name (or id) -> loads, for
    measured samples (empty for a training log). ``per_timestep``: ``(low, high, loads)`` per
    range, in the order the data came (sampling: noisiest first; training: first steps first);
    ``ranges_of`` says what the ranges cover (:data:`TIMESTEP` or :data:`TRAINING_STEP`).
    ``shared_heads`` / ``top_k``: per layer, the always-on heads (the layer's first) and the
    routed top-K the loads were measured at. ``settings``: how they were measured (JSON values).
    """

    overall: Usage
    per_class: dict[str, Usage]
    per_timestep: list[tuple[float, float, Usage]]
    shared_heads: list[int]
    top_k: list[int]
    ranges_of: str = TIMESTEP
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.overall = _check_usage(self.overall, None, "overall")
        heads = self.heads
        self.per_class = {str(k): _check_usage(v, heads, f"class {k}") for k, v in dict(self.per_class).items()}
        ranges = []
        for entry in self.per_timestep:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise ValueError(f"per_timestep entries are (low, high, loads); got {entry!r:.80}.")
            low, high, loads = entry
            if not all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in (low, high)):
                raise ValueError(f"per_timestep range ({low!r}, {high!r}): the bounds must be numbers.")
            ranges.append((float(low), float(high), _check_usage(loads, heads, f"range {low}-{high}")))
        self.per_timestep = ranges
        for name in ("shared_heads", "top_k"):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)) or len(values) != len(heads) or any(
                    isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in values):
                raise ValueError(f"{name} must be one int per layer ({len(heads)}); got {values!r:.80}.")
            setattr(self, name, [int(v) for v in values])
        for layer, (h, s, k) in enumerate(zip(heads, self.shared_heads, self.top_k)):
            if not (0 <= s <= h and 0 <= k <= h - s):
                raise ValueError(f"layer {layer}: {s} shared heads and top-K {k} do not fit its {h} heads.")
        if self.ranges_of not in (TIMESTEP, TRAINING_STEP):
            raise ValueError(f"ranges_of={self.ranges_of!r}; choose {TIMESTEP!r} or {TRAINING_STEP!r}.")

    @property
    def heads(self) -> list[int]:
        """Heads per layer."""
        return [len(row) for row in self.overall]

    @property
    def num_layers(self) -> int:
        return len(self.overall)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: what :meth:`from_dict` reads back (``head_usage.json``)."""
        return {"ranges_of": self.ranges_of, "shared_heads": self.shared_heads, "top_k": self.top_k,
                "overall": self.overall, "per_class": self.per_class,
                "per_timestep": [{"low": low, "high": high, "usage": loads} for low, high, loads in self.per_timestep],
                "settings": self.settings}

    @classmethod
    def from_dict(cls, data: Any) -> "HeadUsage":
        """The :meth:`to_dict` form back; ValueError naming what is missing or wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"head usage must be a JSON object; got {type(data).__name__}.")
        missing = [k for k in ("overall", "shared_heads", "top_k") if k not in data]
        if missing:
            raise ValueError(f"head usage lacks {', '.join(missing)}; give what HeadUsage.to_dict writes.")
        ranges = data.get("per_timestep") or []
        if not isinstance(ranges, list) or not all(isinstance(r, dict) and {"low", "high", "usage"} <= set(r)
                                                   for r in ranges):
            raise ValueError("per_timestep must be a list of {low, high, usage} objects.")
        if not isinstance(data.get("per_class") or {}, dict) or not isinstance(data.get("settings") or {}, dict):
            raise ValueError("per_class and settings must be JSON objects.")
        return cls(overall=data["overall"], per_class=data.get("per_class") or {},
                   per_timestep=[(r["low"], r["high"], r["usage"]) for r in ranges], shared_heads=data["shared_heads"],
                   top_k=data["top_k"], ranges_of=data.get("ranges_of", TIMESTEP), settings=data.get("settings") or {})

    @classmethod
    def from_log_lines(cls, lines: Iterable[str], shared_heads: Sequence[int] | None = None,
                       top_k: Sequence[int] | None = None, bins: int = 4, source: str = "head_usage.jsonl") -> "HeadUsage":
        """The usage over training from ``head_usage.jsonl`` lines (``{"step": N, "usage": [[...], ...]}``).

        ``overall`` is the mean over every logged step, ``per_timestep`` the mean over each of
        ``bins`` equal ranges of training steps (``(first, last logged step)``, empty ranges left
        out). A step logged twice (a resumed run) counts once, with its last line. Without
        ``shared_heads``, a layer's shared heads are its leading heads at load 1 in every
        line; without ``top_k``, it is the routed heads' mean total load (each token uses
        exactly K of them). ``source`` names the log in errors.
        """
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise ValueError(f"bins={bins!r}; give an int >= 1.")
        entries = _parse_log(lines, source)
        steps, usages = list(entries), list(entries.values())
        shared = list(shared_heads) if shared_heads is not None else _leading_ones(usages)
        if top_k is None:
            total = _mean(usages)
            top_k = [int(round(sum(row[s:]))) for row, s in zip(total, shared)]
        ranges = []
        for chosen in np.array_split(np.arange(len(steps)), min(bins, len(steps))):
            if len(chosen):
                ranges.append((steps[chosen[0]], steps[chosen[-1]], _mean([usages[i] for i in chosen])))
        return cls(overall=_mean(usages), per_class={}, per_timestep=ranges, shared_heads=shared, top_k=list(top_k),
                   ranges_of=TRAINING_STEP, settings={"source": str(source), "logged_steps": len(steps),
                                                      "first_step": steps[0], "last_step": steps[-1]})


def _parse_log(lines: Iterable[str], source: str) -> dict[int, Usage]:
    """Step -> usage of every line, sorted by step; ValueError naming the line otherwise."""
    entries: dict[int, Usage] = {}
    heads = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            raise ValueError(f"{source}, line {number}: not JSON; the log is damaged.") from None
        step = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or "usage" not in entry:
            raise ValueError(f'{source}, line {number}: not a head-usage line ({{"step": N, "usage": [[...], ...]}}).')
        usage = _check_usage(entry["usage"], heads, f"{source}, line {number}")
        heads = [len(row) for row in usage]
        entries[step] = usage
    if not entries:
        raise ValueError(f"{source} holds no head-usage line yet; training writes one each time it logs.")
    return dict(sorted(entries.items()))


def _leading_ones(usages: Sequence[Usage]) -> list[int]:
    """Per layer, how many leading heads are used by every token in every measurement."""
    shared = []
    for layer in range(len(usages[0])):
        count = 0
        while count < len(usages[0][layer]) and all(u[layer][count] >= 1 - _TOLERANCE for u in usages):
            count += 1
        shared.append(count)
    return shared


def head_usage_from_log(path: str | os.PathLike, bins: int = 4) -> HeadUsage:
    """The usage over training of a run: ``path`` is its ``head_usage.jsonl`` or the run folder.

    The layout (shared heads, top-K) comes from the run's ``train_config.json`` beside the log
    when it has the model config, else from the log itself (:meth:`HeadUsage.from_log_lines`).
    A last line still being written (no newline yet) is left out.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "head_usage.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give a run's head_usage.jsonl (a MoH-DiT run writes it "
                                "each time it logs) or its run folder.")
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        with contextlib.suppress(ValueError):
            json.loads(lines[-1])
            lines.append("")  # complete after all: keep it
        lines.pop()
    shared, top_k = _run_layout(path.parent / "train_config.json")
    return HeadUsage.from_log_lines(lines, shared_heads=shared, top_k=top_k, bins=bins, source=str(path))


def _run_layout(record: Path) -> tuple[list[int] | None, list[int] | None]:
    """Shared heads and top-K per layer from a run record's model config, or (None, None)."""
    from ..models.layout import HeadLayout

    try:
        config = json.loads(record.read_text(encoding="utf-8"))["model_config"]
        layout = HeadLayout.of_config(config)
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    if layout.shared is None:
        return None, None
    return list(layout.shared), list(layout.top_k)


# --------------------------------------------------------------------------------------
# Measuring while sampling
# --------------------------------------------------------------------------------------


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}; give an int >= 1.")
    return int(value)


def _class_keys(pipe, ids: Sequence[int]) -> list[str]:
    """A name per class id: the pipeline's class name, else the id; unique."""
    null, names = pipe.transformer.config.num_classes, pipe.id2label
    keys = ["unconditional" if i == null else names.get(i, str(i)) for i in ids]
    return [f"{i} {k}" if keys.count(k) > 1 else k for i, k in zip(ids, keys)]


@contextlib.contextmanager
def _recording(pipe, calls: list, bar) -> Iterator[None]:
    """Record ``(timestep, per-layer usage)`` of every transformer call while the block runs (a
    forward hook, removed afterwards); the pipeline's own progress bar is off meanwhile."""

    def hook(module, args, kwargs, output):
        usage = getattr(output, "head_usage", None) if not isinstance(output, tuple) else output[2]
        if usage is None:
            raise RuntimeError("the transformer returned no head usage; the pipeline must pass output_head_usage=True.")
        timestep = kwargs["timestep"] if "timestep" in kwargs else args[1]
        t = float(np.asarray(timestep.detach().cpu() if hasattr(timestep, "detach") else timestep).reshape(-1)[0])
        calls.append((t, [u.detach().float().cpu().tolist() for u in usage]))
        bar.update()

    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    had_config = hasattr(pipe, "_progress_bar_config")
    previous = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(**{**previous, "disable": True})
    try:
        yield
    finally:
        handle.remove()
        if had_config:
            pipe._progress_bar_config = previous
        else:
            del pipe._progress_bar_config


MAX_DEFAULT_CLASSES = 16  # a model with more classes is drawn for 8 of them, spread over the ids


def default_classes(num_classes: int) -> list[int]:
    """The classes drawn when none are named: every class of a model with up to
    :data:`MAX_DEFAULT_CLASSES`, else 8 spread evenly over the ids."""
    if num_classes <= MAX_DEFAULT_CLASSES:
        return list(range(num_classes))
    return sorted({round(i * (num_classes - 1) / 7) for i in range(8)})


def measure_head_usage(
    pipe, classes: Sequence[int | str] | None = None, images_per_class: int = 4, num_inference_steps: int = 50,
    guidance_scale: float = 1.0, head_activation_ratio: float | None = None, seed: int = 0, timestep_bins: int = 4,
    progress: bool = True,
) -> HeadUsage:
    """Sample ``images_per_class`` images of each of ``classes`` (ids or names; None:
    :func:`default_classes`) with ``pipe`` (a ``MoHDiTPipeline``) and record every layer's head
    usage at every denoising step.

    One pipeline call per class (seeds ``seed .. seed + images_per_class - 1`` for every
    class, so the classes share their noise); a forward hook on ``pipe.transformer`` records
    each call's usage and timestep. ``per_class`` is each class's mean over its steps (what
    the pipeline's ``out.head_usage`` is), ``overall`` the mean over all calls, and
    ``per_timestep`` the mean over the calls whose timestep falls in each of ``timestep_bins``
    equal ranges of the scheduler's training timesteps (noisiest first; empty ranges left
    out). With ``guidance_scale > 1`` every call also runs the unconditional half of the
    batch (the null class), which then counts in every view; the default 1 measures the
    classes alone. Latents are not decoded. Bad arguments raise ValueError before sampling.
    """
    images_per_class = _check_count("images_per_class", images_per_class)
    timestep_bins = _check_count("timestep_bins", timestep_bins)
    _check_count("num_inference_steps", num_inference_steps)
    if classes is None:
        classes = default_classes(pipe.transformer.config.num_classes)
    classes = list(classes) if not isinstance(classes, (int, str)) else [classes]
    ids = pipe.get_label_ids(classes)
    if len(set(ids)) != len(ids):
        raise ValueError(f"classes {classes} name a class twice; give each class once.")
    transformer = pipe.transformer
    realised, top_k = preview_head_activation(transformer, head_activation_ratio)
    shared = transformer.layer_shared if transformer.is_moh else list(transformer.layer_heads)
    from tqdm.auto import tqdm

    per_call: list[list[tuple[float, Usage]]] = []
    bar = tqdm(total=len(ids) * num_inference_steps, desc="head usage", unit="step",
               disable=not (progress and info_enabled()))
    try:
        for class_id in ids:
            calls: list[tuple[float, Usage]] = []
            with _recording(pipe, calls, bar):
                pipe([class_id] * images_per_class, guidance_scale=guidance_scale,
                     num_inference_steps=num_inference_steps, head_activation_ratio=head_activation_ratio,
                     seeds=[seed + i for i in range(images_per_class)], output_type="latent", output_head_usage=True)
            per_call.append(calls)
    finally:
        bar.close()
    keys = _class_keys(pipe, ids)
    settings = {"source": "sampling", "classes": dict(zip(keys, ids)), "images_per_class": images_per_class,
                "num_inference_steps": num_inference_steps, "guidance_scale": float(guidance_scale),
                "head_activation_ratio": realised, "seed": seed, "scheduler": type(pipe.scheduler).__name__}
    train_steps = int(getattr(pipe.scheduler.config, "num_train_timesteps", 1000))
    every = [call for calls in per_call for call in calls]
    return HeadUsage(overall=_mean([u for _, u in every]),
                     per_class={key: _mean([u for _, u in calls]) for key, calls in zip(keys, per_call)},
                     per_timestep=_timestep_ranges(every, train_steps, timestep_bins), shared_heads=list(shared),
                     top_k=list(top_k), ranges_of=TIMESTEP, settings=settings)


def _timestep_ranges(calls: Sequence[tuple[float, Usage]], train_steps: int, bins: int) -> list:
    """``(low, high, mean usage)`` for each of ``bins`` equal ranges of [0, train_steps) that
    holds a call, the noisiest range first; ``high`` is the range's last integer timestep."""
    edges = np.linspace(0, train_steps, bins + 1)
    ranges = []
    for i in reversed(range(bins)):
        inside = [u for t, u in calls if edges[i] <= t < edges[i + 1] or (i == bins - 1 and t >= edges[-1])]
        if inside:
            ranges.append((int(math.ceil(edges[i])), int(math.ceil(edges[i + 1])) - 1, _mean(inside)))
    return ranges


# --------------------------------------------------------------------------------------
# The figure
# --------------------------------------------------------------------------------------

_DPI = 100
_BAD = "#d9d9d9"  # a layer with fewer heads than the widest: no head there


def _matrix(loads: Usage, width: int) -> np.ndarray:
    """(layers, width) float array; NaN where a layer has no such head."""
    out = np.full((len(loads), width), np.nan)
    for layer, row in enumerate(loads):
        out[layer, :len(row)] = row
    return out


@dataclass(frozen=True)
class _Grid:
    """Sizes in inches of one figure: cells of the big and the small heatmaps, the widest layer."""

    layers: int
    width: int
    cell: float
    small: float
    columns: int  # small panels per row

    @property
    def panel(self) -> tuple[float, float]:
        return self.width * self.small, self.layers * self.small

    def section_height(self, panels: int) -> float:
        rows = math.ceil(panels / self.columns)
        return 0.5 + rows * (self.panel[1] + 0.75)


def _grid(usage: HeadUsage) -> _Grid:
    layers, width = usage.num_layers, max(usage.heads)
    cell = min(0.55, 4.5 / width, 5.0 / layers)
    small = cell * 0.62
    panels = max(len(usage.per_class), len(usage.per_timestep), 1)
    return _Grid(layers, width, cell, small, columns=max(1, min(panels, int(12 // (width * small + 0.9)), 6)))


def plot_head_usage(usage: HeadUsage, title: str, subtitle: str | None = None):
    """The head-usage figure of ``usage`` as a matplotlib ``Figure`` (Agg canvas).

    Heatmaps with layers as rows and heads as columns, colour = fraction of tokens using the
    head (0 to 1, the same scale everywhere); each layer's shared heads are hatched, left of a
    black line; grey cells are heads a layer does not have. On top, ``overall`` (with its
    values written in the cells when they fit); below, one small panel per class, then one per
    range of ``per_timestep``. Every heatmap's image has a ``gid``: ``"overall"``,
    ``"class:<name>"`` or ``"range:<i>"``; its array holds exactly the plotted loads.
    ``subtitle`` defaults to a line built from ``usage.settings``. :func:`figure_png` renders it.
    """
    grid = _grid(usage)
    sections = [(name, items) for name, items in (
        ("class", list(usage.per_class.items())),
        ("range", [(_range_label(usage.ranges_of, low, high), loads) for low, high, loads in usage.per_timestep]),
    ) if items]
    small_width = grid.columns * (grid.panel[0] + 0.9) + 0.9
    width = max(1.6 + grid.width * grid.cell + 5.2, small_width)
    height = 1.0 + grid.layers * grid.cell + 0.75 + sum(grid.section_height(len(items)) for _, items in sections)
    figure = new_figure(width, height, _DPI)
    place = _Placer(figure, width, height)
    figure.text(0.25 / width, 1 - 0.3 / height, title, ha="left", va="center", fontsize=13, weight="bold")
    figure.text(0.25 / width, 1 - 0.62 / height, subtitle if subtitle is not None else _subtitle(usage), ha="left",
                va="center", fontsize=9, color="#444444")
    top = 1.0
    ax = place(1.6, top, grid.width * grid.cell, grid.layers * grid.cell)
    image = _heatmap(ax, usage, usage.overall, grid.width, "overall", labels="long", values=grid.cell >= 0.35)
    ax.set_title("overall", fontsize=11, loc="left")
    figure.colorbar(image, cax=place(1.6 + grid.width * grid.cell + 0.25, top, 0.18, grid.layers * grid.cell),
                    label="load")
    _legend(figure, usage, (1.6 + grid.width * grid.cell + 1.3) / width, 1 - (top + 0.1) / height)
    top += grid.layers * grid.cell + 0.75
    for name, items in sections:
        figure.text(0.25 / width, 1 - (top + 0.15) / height, _section_title(usage, name), ha="left", va="center",
                    fontsize=11)
        _small_multiples(place, usage, grid, name, items, top + 0.55)
        top += grid.section_height(len(items))
    return figure


class _Placer:
    """Axes placed in inches from the figure's top-left corner."""

    def __init__(self, figure, width: float, height: float):
        self.figure, self.width, self.height = figure, width, height

    def __call__(self, left: float, top: float, w: float, h: float):
        return self.figure.add_axes((left / self.width, 1 - (top + h) / self.height, w / self.width, h / self.height))


def _small_multiples(place: _Placer, usage: HeadUsage, grid: _Grid, name: str, items, top: float) -> None:
    panel_w, panel_h = grid.panel
    for i, (label, loads) in enumerate(items):
        row, column = divmod(i, grid.columns)
        ax = place(0.9 + column * (panel_w + 0.9), top + row * (panel_h + 0.75), panel_w, panel_h)
        gid = f"class:{label}" if name == "class" else f"range:{i}"
        _heatmap(ax, usage, loads, grid.width, gid, labels="short" if column == 0 else None,
                 values=grid.small >= 0.3)
        shown = label.split(",")[0]
        ax.set_title(shown if len(shown) <= 22 else shown[:21] + "…", fontsize=9)


def _heatmap(ax, usage: HeadUsage, loads: Usage, width: int, gid: str, labels: str | None, values: bool):
    import matplotlib
    from matplotlib.patches import Rectangle

    data = np.ma.masked_invalid(_matrix(loads, width))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad=_BAD)
    image = ax.imshow(data, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    image.set_gid(gid)
    for layer, (heads, shared) in enumerate(zip(usage.heads, usage.shared_heads)):
        if shared:
            ax.add_patch(Rectangle((-0.5, layer - 0.5), shared, 1, fill=False, hatch="////", edgecolor="#ffffff",
                                   linewidth=0, alpha=0.55))
        if 0 < shared < heads:
            ax.plot([shared - 0.5, shared - 0.5], [layer - 0.5, layer + 0.5], color="black", linewidth=2.2,
                    solid_capstyle="butt")
    ax.set_xticks(np.arange(width + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(usage.num_layers + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    step = max(1, math.ceil(width / 12))
    ax.set_xticks(range(0, width, step))
    ax.tick_params(labelsize=8 if labels == "long" else 7, length=2)
    ax.set_xlabel("head", fontsize=8, labelpad=1)
    rows = range(0, usage.num_layers, max(1, math.ceil(usage.num_layers / 16)))
    ax.set_yticks(list(rows))
    if labels == "long":
        ax.set_yticklabels([_layer_label(usage, layer) for layer in rows])
    elif labels == "short":
        ax.set_yticklabels([f"L{layer}" for layer in rows])
    else:
        ax.set_yticklabels([])
    if values:
        for (layer, head), value in np.ndenumerate(data.filled(np.nan)):
            if not np.isnan(value):
                ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=8 if labels == "long" else 6,
                        color="black" if value > 0.6 else "white")
    return image


def _layer_label(usage: HeadUsage, layer: int) -> str:
    heads, shared, k = usage.heads[layer], usage.shared_heads[layer], usage.top_k[layer]
    routed = heads - shared
    return f"L{layer}  {shared} + {k}/{routed}" if routed else f"L{layer}  {shared} shared"


def _legend(figure, usage: HeadUsage, x: float, y: float) -> None:
    lines = ["How to read it",
             "colour (load): fraction of tokens that use the head",
             "hatched, left of the black line: shared heads",
             "    (always on: load 1)",
             "row label  L<i>  s + k/r: layer i has s shared heads",
             "    and each token picks its top-k of r routed heads",
             "uniform routing gives every routed head k/r"]
    if len(set(usage.heads)) > 1:
        lines.append("grey: the layer has no such head")
    figure.text(x, y, "\n".join(lines), ha="left", va="top", fontsize=8.5, linespacing=1.5, color="#222222")


def _range_label(ranges_of: str, low: float, high: float) -> str:
    low_s, high_s = (f"{v:g}" for v in (low, high))
    return f"t {high_s}–{low_s}" if ranges_of == TIMESTEP else f"steps {low_s}–{high_s}"


def _section_title(usage: HeadUsage, name: str) -> str:
    if name == "class":
        n = usage.settings.get("images_per_class")
        return f"per class{f' ({n} images each, all steps)' if n else ''}"
    if usage.ranges_of == TIMESTEP:
        return "per timestep range, in sampling order (t = 999: pure noise, t = 0: the image)"
    return "over training: mean over the logged steps of each range"


def _subtitle(usage: HeadUsage) -> str:
    s = usage.settings
    if s.get("source") == "sampling":
        ratio = s.get("head_activation_ratio")
        return (f"{len(s.get('classes', {}))} classes x {s.get('images_per_class')} images, "
                f"{s.get('num_inference_steps')} {s.get('scheduler', '')} steps, guidance {s.get('guidance_scale')}, "
                f"head activation {ratio:.3f}" if isinstance(ratio, float) else "sampled")
    if usage.ranges_of == TRAINING_STEP:
        return (f"training log {Path(str(s.get('source', ''))).name}: {s.get('logged_steps')} logged steps, "
                f"steps {s.get('first_step')} to {s.get('last_step')}")
    return ""


def write_head_usage(usage: HeadUsage, folder: str | os.PathLike, title: str,
                     subtitle: str | None = None) -> dict[str, Path]:
    """Write ``head_usage.png`` (:func:`plot_head_usage`) and ``head_usage.json`` (the plotted
    numbers, :meth:`HeadUsage.to_dict`) into ``folder``, each atomically; returns
    ``{"png": path, "json": path}``. Replaces those two files, touches nothing else."""
    folder = Path(folder)
    png = write_bytes_atomic(folder / PLOT_FILE, figure_png(plot_head_usage(usage, title, subtitle)))
    return {"png": png, "json": write_json_atomic(folder / JSON_FILE, usage.to_dict())}


def head_usage_figure_for_tracker(log: str | os.PathLike, title: str = "head usage", bins: int = 4):
    """The figure of a run's ``head_usage.jsonl`` (or run folder) as a (1, 3, H, W) float tensor
    in [0, 1], ready for an image tracker; None while the log does not exist or holds no line."""
    import torch

    try:
        usage = head_usage_from_log(log, bins=bins)
    except FileNotFoundError:
        return None
    except ValueError as error:
        if "no head-usage line" in str(error):
            return None
        raise
    rgb = figure_rgb(plot_head_usage(usage, title))
    return torch.from_numpy(rgb).permute(2, 0, 1)[None].float() / 255.0
