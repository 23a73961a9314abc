"""Which attention heads a MoH-DiT uses, measured while sampling or read from a training log, and
drawn as heatmaps (layers as rows, heads as columns).

The load of a head is the fraction of tokens that use it: 1 for a shared head, ``K / routed`` on
average for a routed head of a layer with top-K ``K``. :class:`HeadUsage` holds it per layer and
head, overall, per class and per range of timesteps (of training steps, for a log).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .outputs import atomic_write, write_json

__all__ = ["JSON_FILE", "PLOT_FILE", "TIMESTEP", "TRAINING_STEP", "HeadUsage", "default_classes",
           "head_usage_from_log", "measure_head_usage", "plot_head_usage", "write_head_usage"]

PLOT_FILE, JSON_FILE = "head_usage.png", "head_usage.json"
TIMESTEP, TRAINING_STEP = "timestep", "training step"  # what the ranges of ``per_timestep`` cover

Usage = list[list[float]]  # per layer, the load of each head (layers may differ in head count)


@dataclass
class HeadUsage:
    """Head loads in three views: ``overall``; ``per_class`` (name -> loads; empty for a log);
    ``per_timestep``, ``(low, high, loads)`` per range in the order the data came (sampling:
    noisiest first). ``shared_heads`` / ``top_k``: per layer, the always-on heads (the layer's
    first) and the routed top-K the loads were measured at."""

    overall: Usage
    per_class: dict[str, Usage]
    per_timestep: list[tuple[float, float, Usage]]
    shared_heads: list[int]
    top_k: list[int]
    ranges_of: str = TIMESTEP
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"ranges_of": self.ranges_of, "shared_heads": self.shared_heads, "top_k": self.top_k,
                "overall": self.overall, "per_class": self.per_class,
                "per_timestep": [{"low": lo, "high": hi, "usage": u} for lo, hi, u in self.per_timestep],
                "settings": self.settings}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HeadUsage":
        return cls(data["overall"], data.get("per_class", {}),
                   [(r["low"], r["high"], r["usage"]) for r in data.get("per_timestep", [])],
                   data["shared_heads"], data["top_k"], data.get("ranges_of", TIMESTEP), data.get("settings", {}))


def _mean(usages: Sequence[Usage]) -> Usage:
    return [np.mean([u[layer] for u in usages], axis=0, dtype=np.float64).tolist() for layer in range(len(usages[0]))]


def _layout(model_config: dict) -> tuple[list[int], list[int]]:
    """(shared heads, trained top-K) per layer of a transformer config; every head shared in a dense DiT."""
    from .models import HeadLayout

    layout = HeadLayout.of_config(model_config)
    if layout.shared is None:
        return list(layout.heads), [0] * len(layout.heads)
    return list(layout.shared), list(layout.top_k)


# ----- a training log -------------------------------------------------------------------------

def head_usage_from_log(path: str | os.PathLike, bins: int = 4) -> HeadUsage:
    """The usage over training from a run's ``head_usage.jsonl`` (or the run folder): the mean over
    every logged step, and over each of ``bins`` equal ranges of the logged steps. A step logged
    twice (a resumed run) counts once, with its last line; a last line still being written is left
    out. The layout comes from the run's ``train_config.json``, else from the loads themselves."""
    path = Path(path)
    if path.is_dir():
        path = path / "head_usage.jsonl"
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()[:None if text.endswith("\n") else -1]
    entries: dict[int, Usage] = {}
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                entry = json.loads(line)
                entries[int(entry["step"])] = entry["usage"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}, line {number}: not a head-usage line ({{\"step\": N, \"usage\": "
                                 "[[...], ...]}); the log is damaged") from None
    if not entries:
        raise ValueError(f"{path} holds no head-usage line yet; training writes one each time it logs")
    steps = sorted(entries)
    usages = [entries[s] for s in steps]
    try:
        config = json.loads((path.parent / "train_config.json").read_text(encoding="utf-8"))
        shared, top_k = _layout(config.get("model_config") or config["model"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        shared = [next((i for i, v in enumerate(row) if v < 1 - 1e-6), len(row)) for row in _mean(usages)]
        top_k = [round(sum(row[s:])) for row, s in zip(_mean(usages), shared)]  # each token uses K routed heads
    ranges = [(steps[c[0]], steps[c[-1]], _mean([usages[i] for i in c]))
              for c in np.array_split(np.arange(len(steps)), min(bins, len(steps)))]
    return HeadUsage(_mean(usages), {}, ranges, shared, top_k, TRAINING_STEP,
                     {"source": str(path), "logged_steps": len(steps), "first_step": steps[0], "last_step": steps[-1]})


# ----- measuring while sampling ---------------------------------------------------------------

def default_classes(num_classes: int) -> list[int]:
    """Every class of a model with up to 16, else 8 spread evenly over the ids."""
    if num_classes <= 16:
        return list(range(num_classes))
    return sorted({round(i * (num_classes - 1) / 7) for i in range(8)})


def measure_head_usage(pipe, classes: Sequence[int | str] | None = None, images_per_class: int = 4,
                       num_inference_steps: int = 50, guidance_scale: float = 1.0,
                       head_activation_ratio: float | None = None, seed: int = 0, timestep_bins: int = 4,
                       progress: bool = True) -> HeadUsage:
    """Sample ``images_per_class`` images of each class (seeds ``seed + i``, the same for every class)
    and record every transformer call's head usage (a forward hook): ``per_class`` is each class's
    mean over its calls (the pipeline's ``out.head_usage``), ``per_timestep`` the mean over the calls
    in each of ``timestep_bins`` equal ranges of the training timesteps, noisiest first. With
    guidance the unconditional half of each call counts too. Latents are never decoded."""
    from tqdm.auto import tqdm

    from .models import head_activation

    transformer = pipe.transformer
    if not transformer.is_moh:
        raise ValueError("a dense DiT: every token uses every head, so there is no head usage to measure")
    ids = pipe.get_label_ids(list(default_classes(transformer.config.num_classes) if classes is None else classes))
    calls: list[list[tuple[float, Usage]]] = []

    def record(module, args, kwargs, output):
        t = kwargs["timestep"] if "timestep" in kwargs else args[1]
        calls[-1].append((float(t.reshape(-1)[0]), [u.double().cpu().tolist() for u in output.head_usage]))

    handle = transformer.register_forward_hook(record, with_kwargs=True)
    pipe.set_progress_bar_config(disable=True)
    try:
        for class_id in tqdm(ids, desc="head usage", disable=not progress):
            calls.append([])
            pipe([class_id] * images_per_class, guidance_scale=guidance_scale, num_inference_steps=num_inference_steps,
                 head_activation_ratio=head_activation_ratio, seeds=[seed + i for i in range(images_per_class)],
                 output_type="latent", output_head_usage=True)
    finally:
        handle.remove()
    with head_activation(transformer, head_activation_ratio) as realised:
        top_k = list(transformer.top_k_per_layer)
    names = getattr(pipe, "id2label", None) or {}
    keys = [f"{i} {names[i]}" if i in names else str(i) for i in ids]
    edges = np.linspace(0, pipe.scheduler.config.num_train_timesteps, timestep_bins + 1)
    every = [call for per_class in calls for call in per_class]
    ranges = []
    for lo, hi in reversed(list(zip(edges[:-1], edges[1:]))):
        inside = [u for t, u in every if lo <= t < hi or (hi == edges[-1] and t >= hi)]
        if inside:
            ranges.append((math.ceil(lo), math.ceil(hi) - 1, _mean(inside)))
    settings = {"source": "sampling", "classes": dict(zip(keys, ids)), "images_per_class": images_per_class,
                "num_inference_steps": num_inference_steps, "guidance_scale": float(guidance_scale),
                "head_activation_ratio": realised, "seed": seed, "scheduler": type(pipe.scheduler).__name__}
    return HeadUsage(_mean([u for _, u in every]), {k: _mean([u for _, u in c]) for k, c in zip(keys, calls)},
                     ranges, _layout(transformer.config)[0], top_k, TIMESTEP, settings)


# ----- the figure -----------------------------------------------------------------------------

def plot_head_usage(usage: HeadUsage, title: str, subtitle: str | None = None):
    """The heatmaps of ``usage`` as a matplotlib ``Figure`` (no pyplot): ``overall`` first (values
    written in the cells), then one per class and one per range, on one 0-1 colour scale. Shared
    heads are hatched, left of a black line; grey cells are heads a layer does not have. Each
    heatmap's image has a gid (``overall``, ``class:<name>``, ``range:<i>``) and holds the loads."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    panels = [("overall", "overall", usage.overall)]
    panels += [(f"class:{name}", f"class {name}", loads) for name, loads in usage.per_class.items()]
    panels += [(f"range:{i}", (f"t {hi:g}-{lo:g}" if usage.ranges_of == TIMESTEP else f"steps {lo:g}-{hi:g}"), loads)
               for i, (lo, hi, loads) in enumerate(usage.per_timestep)]
    layers, width = len(usage.overall), max(map(len, usage.overall))
    cell = min(0.4, 3.5 / max(width, layers))
    columns = min(4, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(columns * (width * cell + 1.3) + 1.2, rows * (layers * cell + 0.9) + 1.0), dpi=100,
                    layout="constrained")
    figure.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=11)
    axes = figure.subplots(rows, columns, squeeze=False)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")
    for n, (ax, (gid, label, loads)) in enumerate(zip(axes.flat, panels)):
        data = np.full((layers, width), np.nan)
        for layer, row in enumerate(loads):
            data[layer, :len(row)] = row
        image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto",
                          interpolation="nearest")
        image.set_gid(gid)
        for layer, (heads, shared) in enumerate(zip(map(len, usage.overall), usage.shared_heads)):
            if shared:
                ax.add_patch(Rectangle((-0.5, layer - 0.5), shared, 1, fill=False, hatch="////", edgecolor="white",
                                       linewidth=0, alpha=0.55))
            if 0 < shared < heads:
                ax.plot([shared - 0.5] * 2, [layer - 0.5, layer + 0.5], color="black", linewidth=2)
        if gid == "overall" and cell >= 0.3:
            for (layer, head), value in np.ndenumerate(data):
                if not np.isnan(value):
                    ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=7,
                            color="black" if value > 0.6 else "white")
        ax.set_xticks(range(0, width, math.ceil(width / 12)))
        ax.set_title(label if len(label) <= 24 else label[:23] + "…", fontsize=9)
        ax.set_xlabel("head", fontsize=8)
        ax.set_yticks(range(layers), [(f"L{i}  {s} + {k}/{len(row) - s}" if len(row) > s else f"L{i}  {s} shared")
                                      if n % columns == 0 else "" for i, (row, s, k)
                                      in enumerate(zip(usage.overall, usage.shared_heads, usage.top_k))], fontsize=7)
        ax.tick_params(labelsize=7, length=2)
    for ax in axes.flat[len(panels):]:
        ax.set_axis_off()
    figure.colorbar(image, ax=axes, label="load: fraction of tokens using the head (hatched: shared)", shrink=0.8)
    return figure


def write_head_usage(usage: HeadUsage, folder: str | os.PathLike, title: str) -> dict[str, Path]:
    """``head_usage.png`` and ``head_usage.json`` (the plotted numbers) into ``folder``, each atomically."""
    folder = Path(folder)
    with atomic_write(folder / PLOT_FILE) as f:
        plot_head_usage(usage, title, _subtitle(usage)).savefig(f, format="png")
    return {"png": folder / PLOT_FILE, "json": write_json(folder / JSON_FILE, usage.to_dict())}


def _subtitle(usage: HeadUsage) -> str:
    s = usage.settings
    if usage.ranges_of == TRAINING_STEP:
        return f"training log: {s.get('logged_steps')} logged steps, {s.get('first_step')} to {s.get('last_step')}"
    if s.get("source") != "sampling":
        return ""
    return (f"{len(s.get('classes', {}))} classes x {s.get('images_per_class')} images, "
            f"{s.get('num_inference_steps')} steps, guidance {s.get('guidance_scale')}, "
            f"head activation {s.get('head_activation_ratio', 1.0):.3f}; L3  1 + 2/3: 1 shared, top-2 of 3 routed")
