"""The FID-versus-head-activation sweep: quality and attention cost of one model at several ratios.

For each ratio (a number, ``"trained"``, ``"min"`` or a pipeline schedule such as
``"linear:0.5:1.0"``) the same images are sampled (image ``i``: class ``i mod num_classes``,
seed ``seed + i``), streamed into ADM's metrics against one reference whose statistics are
computed once, with a bootstrap interval for FID, and costed in ideal head-sparse attention
FLOPs. Requests that realise the same ratio share a row.

    >>> result = sweep("runs/b2-75", ["trained", 1.0, 0.75, "min"], reference="VIRTUAL_imagenet256_labeled.npz",
    ...                num_samples=10_000, device="cuda", output_dir="sweeps/b2-75")
    >>> print(table(result))     # output_dir gets sweep.json, sweep.csv and fid_vs_ratio.png
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..outputs import atomic_write, output_folder, write_bytes, write_json
from . import class_labels_for, generate, load_pipeline, png_path, save_png

__all__ = ["CSV_FILE", "DEFAULT_RATIOS", "JSON_FILE", "PLOT_FILE", "plot_sweep", "sweep", "table", "wilson_interval"]

DEFAULT_RATIOS = ("trained", 1.0, 0.9, 0.75, 0.6, "min")
JSON_FILE, CSV_FILE, PLOT_FILE = "sweep.json", "sweep.csv", "fid_vs_ratio.png"
CSV_COLUMNS = ("ratio", "realised_ratio", "fid", "fid_low", "fid_high", "sfid", "inception_score", "precision",
               "recall", "class_accuracy", "class_accuracy_low", "class_accuracy_high", "attention_flop_ratio",
               "attention_flops_per_image", "seconds_per_image", "top_k_per_layer")


def wilson_interval(correct: int, total: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (inside [0, 1], never zero-width at the ends)."""
    p, zz = correct / total, z * z / total
    centre, half = (p + zz / 2) / (1 + zz), z * math.sqrt(p * (1 - p) / total + zz / (4 * total)) / (1 + zz)
    return max(0.0, centre - half), min(1.0, centre + half)


def _bootstrap(pool: np.ndarray, reference, fid: float, resamples: int, seed: int) -> tuple[float, float, float]:
    """(low, high, bias) of FID's 95% bootstrap interval: the samples' features drawn with replacement
    against the fixed reference. Repeated images alone raise FID (``bias``, the mean minus ``fid``),
    so the percentiles are shifted back by it and the interval sits around the measured FID."""
    from ..evaluation import fid_from_features

    rng = np.random.default_rng(seed)
    values = [fid_from_features(pool[rng.integers(0, len(pool), len(pool))], reference) for _ in range(resamples)]
    bias = float(np.mean(values)) - fid
    low, high = np.percentile(values, [2.5, 97.5]) - bias
    return float(low), float(high), bias


def _cost(transformer, step_ratios: Sequence[float]) -> tuple[float, float, list[int]]:
    """(mean ideal head-sparse attention FLOPs of one forward pass, the dense ones, the last step's
    top-K per layer) at the realised ratio of every step."""
    from ..models import head_activation, model_attention_flops

    counted = {}
    for ratio in set(step_ratios):
        with head_activation(transformer, ratio):
            counted[ratio] = (*model_attention_flops(transformer), list(transformer.top_k_per_layer))
    sparse = sum(counted[r][0] for r in step_ratios) / len(step_ratios)
    return sparse, counted[step_ratios[0]][1], counted[step_ratios[-1]][2]


def sweep(model, ratios: Sequence[float | str] = DEFAULT_RATIOS, *, reference, output_dir=None,
          overwrite: bool = False, num_samples: int = 50_000, batch_size: int = 32, num_inference_steps: int = 250,
          guidance_scale: float = 1.5, guidance_channels: str = "dit", seed: int = 0, vae: str | None = None,
          scheduler: str | None = "ddpm", dtype: torch.dtype | None = None, device: str = "cpu",
          sparse_attention: bool = False, extractor=None, inception_weights=None,
          random_inception_seed: int | None = None, download: bool = True, eval_batch_size: int = 64,
          cache_dir=None, use_cache: bool = True, classifier=None, classifier_weights=None, bootstrap: int = 200,
          bootstrap_seed: int = 0, save_samples: bool = False, head_usage_images: int = 0,
          progress: bool = True) -> dict[str, Any]:
    """Sample and evaluate ``model`` (a ``MoHDiTPipeline`` or what ``load_pipeline`` takes, loaded
    once) at each of ``ratios``; returns ``{"settings": ..., "rows": [...]}``, highest ratio first.

    The feature network is ``extractor``, else a seeded random Inception (``random_inception_seed``:
    offline demos, NOT comparable to published numbers), else the TF Inception. ``classifier``
    (a ``SampleClassifier``, a train-classifier folder or ``torchvision:NAME``) adds class accuracy
    with a Wilson interval; ``bootstrap`` resamples give FID's interval (0: none). With
    ``output_dir`` the folder is built whole and published on success: ``sweep.json``, ``sweep.csv``,
    ``fid_vs_ratio.png``, each ratio's PNGs under ``ratio_X/samples/`` (``save_samples``) and the
    head-usage figure of ``head_usage_images`` images per class under ``head_usage/``.
    """
    from ..evaluation import (build_random_inception, compute_metrics, extract_features, extractor_identity,
                              load_classifier, load_inception, load_reference, ClassAccuracyMeter)

    local = {"model": model, "reference": reference, "vae": vae, "classifier": classifier}
    inputs = {k: v for k, v in local.items() if isinstance(v, (str, os.PathLike)) and Path(v).exists()}
    held = (output_folder(output_dir, "sweep", overwrite=overwrite, publish=True, inputs=inputs) if output_dir
            else contextlib.nullcontext(None))
    with held as folder:
        pipe = model if hasattr(model, "transformer") else load_pipeline(model, vae, scheduler, dtype=dtype)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        transformer = pipe.transformer
        if sparse_attention:
            transformer.set_sparse_inference(True)
        if extractor is None:
            extractor = (build_random_inception(random_inception_seed) if random_inception_seed is not None
                         else load_inception(inception_weights, download=download))
        ref = load_reference(reference, extractor, device=device, batch_size=eval_batch_size, cache_dir=cache_dir,
                             use_cache=use_cache)
        if isinstance(classifier, (str, os.PathLike)):
            classifier = load_classifier(classifier, classifier_weights, device=device)
        images = dict(guidance_scale=guidance_scale, guidance_channels=guidance_channels,
                      num_inference_steps=num_inference_steps, seed=seed)
        calls = num_inference_steps * (2 if guidance_scale > 1 else 1)  # guidance runs the null class too
        rows = []
        for plan in _plan(pipe, ratios, images):
            samples_dir = None if not save_samples or folder is None else folder / plan["folder"]
            meter = None
            if classifier is not None:
                labels = class_labels_for(np.arange(num_samples), transformer.config.num_classes)
                meter = ClassAccuracyMeter(classifier, labels, None, num_samples)
            seconds = [0.0]
            features = extract_features(_batches(pipe, plan, images, num_samples, batch_size, samples_dir, seconds),
                                        extractor, device=device, batch_size=eval_batch_size,
                                        on_batch=None if meter is None else meter.update)
            row = {"ratio": "/".join(plan["requested"]), "requested": plan["requested"],
                   "realised_ratio": plan["realised"], "head_activation_ratios": plan["schedule"],
                   **compute_metrics(features, ref, device=device)}
            if bootstrap and row["fid"] is not None:
                row["fid_low"], row["fid_high"], row["fid_bootstrap_bias"] = _bootstrap(
                    features.pool, ref, row["fid"], bootstrap, bootstrap_seed)
            if meter is not None:
                row.update(meter.result())
                row["class_accuracy_low"], row["class_accuracy_high"] = wilson_interval(
                    round(row["class_accuracy"] * num_samples), num_samples)
            sparse, dense, top_k = _cost(transformer, plan["steps"])
            row.update(attention_flop_ratio=sparse / dense, mean_attention_flops=sparse,
                       attention_flops_per_image=sparse * calls, dense_attention_flops_per_image=dense * calls,
                       top_k_per_layer=None if plan["schedule"] else top_k, sampling_seconds=seconds[0],
                       seconds_per_image=seconds[0] / num_samples, num_samples=num_samples,
                       samples_dir=None if samples_dir is None else str(Path(output_dir) / plan["folder"]))
            rows.append(row)
        result = {"settings": {
            "model": str(Path(model).resolve()) if isinstance(model, (str, os.PathLike)) else type(model).__name__,
            "ratios": [str(r) for r in ratios], "num_samples": num_samples, **images,
            "scheduler": type(pipe.scheduler).__name__, "transformer_calls_per_image": calls, "device": str(device),
            "reference": ref.source, "reference_from_cache": ref.from_cache, "extractor": extractor_identity(extractor),
            "comparable_to_published": bool(getattr(extractor, "comparable_to_published", False)),
            "bootstrap_resamples": bootstrap, "bootstrap_seed": bootstrap_seed,
            "flops_note": "ideal head-sparse attention FLOPs (selected heads' queries, outputs and attention core) of "
                          "all transformer calls of one image; routers, MLPs and the VAE not counted"},
            "rows": rows}
        if folder is not None:
            _write(result, folder, pipe, head_usage_images, progress)
    return result


def _plan(pipe, ratios: Sequence[float | str], images: dict) -> list[dict]:
    """One plan per realised ratio (or schedule), highest first, schedules last. Each ratio runs one
    image first: the pipeline checks it against the model before any sampling, and says what it realises."""
    plans: dict[Any, dict] = {}
    for ratio in ratios:
        value = {"trained": None, "min": pipe.transformer.head_activation_range[0]}.get(ratio, ratio)
        _, out = generate(pipe, [0], head_activation_ratio=value, **images)
        schedule = str(ratio).startswith("linear:")
        key = ratio if schedule else round(out.head_activation_ratio, 9)
        plans.setdefault(key, {
            "requested": [], "value": value, "steps": out.head_activation_ratios, "realised": out.head_activation_ratio,
            "schedule": out.head_activation_ratios if schedule else None,
            "folder": "ratio_" + (ratio.replace(":", "_") if schedule else f"{out.head_activation_ratio:.4f}"),
        })["requested"].append(str(ratio))
    return sorted(plans.values(), key=lambda plan: (plan["schedule"] is not None, -plan["realised"]))


def _batches(pipe, plan: dict, images: dict, num_samples: int, batch_size: int, samples_dir: Path | None,
             seconds: list[float]):
    """uint8 (B, H, W, 3) batches of images 0 .. num_samples - 1 at ``plan``'s ratio, saved as PNGs
    into ``samples_dir`` when given; the sampling time (not the evaluation's) is added to ``seconds``."""
    for start in range(0, num_samples, batch_size):
        began = time.perf_counter()
        batch = list(range(start, min(start + batch_size, num_samples)))
        made, _ = generate(pipe, batch, head_activation_ratio=plan["value"], **images)
        seconds[0] += time.perf_counter() - began
        for index, image in zip(batch, made if samples_dir is not None else ()):
            save_png(png_path(samples_dir, index), image)
        yield made


def _write(result: dict, folder: Path, pipe, head_usage_images: int, progress: bool) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in result["rows"]:
        values = {**row, "top_k_per_layer": " ".join(map(str, row.get("top_k_per_layer") or []))}
        writer.writerow(["" if values.get(c) is None else values[c] for c in CSV_COLUMNS])
    write_bytes(folder / CSV_FILE, buffer.getvalue().encode())
    with atomic_write(folder / PLOT_FILE) as f:
        plot_sweep(result).savefig(f, format="png")
    if head_usage_images and pipe.transformer.is_moh:
        from ..head_usage import measure_head_usage, write_head_usage

        usage = measure_head_usage(pipe, images_per_class=head_usage_images, progress=progress,
                                   num_inference_steps=result["settings"]["num_inference_steps"],
                                   seed=result["settings"]["seed"])
        write_head_usage(usage, folder / "head_usage", f"{Path(result['settings']['model']).name}: head usage")
    write_json(folder / JSON_FILE, result)


def plot_sweep(result: dict):
    """FID (and class accuracy, when measured) against the mean attention FLOPs relative to dense, as a
    matplotlib ``Figure``: constant ratios joined by a line (the trained one a star), each schedule a
    marker of its own, 95% intervals as error bars; FID from 0, class accuracy on [0, 1]."""
    from matplotlib.figure import Figure

    rows, settings = result["rows"], result["settings"]
    panels = [("fid", "FID")] + [("class_accuracy", "class accuracy")] * any(r.get("class_accuracy") is not None
                                                                           for r in rows)
    figure = Figure(figsize=(9, 5.2), dpi=100, layout="constrained")
    comparable = settings["comparable_to_published"]
    figure.suptitle(f"{Path(settings['model']).name}: {settings['num_samples']} samples per ratio, "
                    f"{settings['num_inference_steps']} steps, guidance {settings['guidance_scale']}\n"
                    + ("ADM-comparable (published TF Inception)" if comparable else
                       f"{settings['extractor']}: NOT comparable to published numbers"), fontsize=10)
    for ax, (name, label) in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels):
        def draw(subset, **style):
            subset = [r for r in subset if r.get(name) is not None]
            x, y = [r["attention_flop_ratio"] for r in subset], [r[name] for r in subset]
            low = [r.get(f"{name}_low") for r in subset]
            error = None if None in low or not low else [[v - r[f"{name}_low"] for v, r in zip(y, subset)],
                                                         [r[f"{name}_high"] - v for v, r in zip(y, subset)]]
            ax.errorbar(x, y, yerr=error, capsize=3, **style)

        constants = sorted((r for r in rows if r["head_activation_ratios"] is None),
                           key=lambda r: r["attention_flop_ratio"])
        draw(constants, marker="o", color="#1f5ab4", label="constant ratio")
        draw([r for r in constants if "trained" in r["requested"]], marker="*", markersize=14, linestyle="none",
             color="#1f5ab4", label="trained ratio")
        schedules = [r for r in rows if r["head_activation_ratios"] is not None]
        for i, row in enumerate(schedules):
            draw([row], marker="s^DvPX"[i % 6], color=f"C{i % 9 + 1}", linestyle="none", label=row["ratio"])
        top = max([r.get(f"{name}_high") or r.get(name) or 0 for r in rows])
        ax.set_ylim(0, 1.02 if name == "class_accuracy" else 1.15 * top or 1)
        ax.set_xlabel("attention FLOPs / dense (mean over the steps)")
        ax.set_ylabel(label)
        ax.grid(True, color="#e1e1e1")
        ax.legend(fontsize=8)
    return figure


def table(result: dict) -> str:
    """The rows as a fixed-width table for the terminal."""
    columns = [("ratio", "{}", 16), ("realised_ratio", "{:.4f}", 9), ("fid", "{:.2f}", 8), ("fid_low", "{:.2f}", 8),
               ("fid_high", "{:.2f}", 8), ("sfid", "{:.2f}", 8), ("inception_score", "{:.2f}", 8),
               ("precision", "{:.3f}", 7), ("recall", "{:.3f}", 7), ("class_accuracy", "{:.3f}", 8),
               ("attention_flop_ratio", "{:.3f}", 8), ("seconds_per_image", "{:.4f}", 9)]
    heads = ["ratio", "realised", "FID", "FID low", "FID high", "sFID", "IS", "prec", "rec", "cls acc", "FLOPs",
             "s/img"]
    lines = ["".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, (_, _, w)) in enumerate(zip(heads, columns)))]
    for row in result["rows"]:
        lines.append("".join((f"{'-' if row.get(k) is None else f.format(row[k]):>{w}}" if i else f"{row[k]:<{w}}")
                             for i, (k, f, w) in enumerate(columns)))
    comparable = result["settings"]["comparable_to_published"]
    lines.append(f"extractor: {result['settings']['extractor']}" + ("" if comparable else " (NOT comparable to "
                                                                                         "published numbers)"))
    return "\n".join(lines)
