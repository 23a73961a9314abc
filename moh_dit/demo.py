"""The whole job offline on a CPU, on the shapes the package draws (:mod:`moh_dit.data.demo_data`).

:func:`demo` (``moh-dit demo``): the dataset and a held-out set of it; a small CNN of the real
images (its held-out accuracy bounds the samples' class accuracy); a tiny MoH-DiT trained in pixel
space; ``ratios.png``, one sample of every class at every head, the trained ratio and the fewest
heads; the head-activation sweep (FID, sFID, IS, precision, recall, class accuracy, attention
FLOPs) against the held-out images, with its plot and the head-usage figure.

:func:`upcycle_demo` (``moh-dit upcycle-demo``): a dense DiT-Tiny/2 trained N steps, upcycled to
MoH-DiT-Tiny/2-up75 and continued M steps (the routers alone first), against the dense model
continued M steps and the MoH model trained from scratch N + M steps, all scored alike.

Without Inception weights (``inception_weights``, ``MOH_DIT_INCEPTION_WEIGHTS`` or the torch hub
cache) FID uses a seeded random InceptionV3, whose numbers compare the demo's models with each
other only. Rerunning the same call continues where it stopped: finished stages are kept and a
training resumes from its last checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

from .outputs import atomic_write, output_folder, read_json, write_json

__all__ = ["demo", "ratio_picture", "upcycle_demo"]

logger = logging.getLogger(__name__)
SETTINGS = "demo_settings.json"
RATIOS = (1.0, 0.9, "trained", 0.6, "min")  # the sweep's
# A tiny model and a short run: a higher learning rate and a faster EMA than the paper's 1e-4 /
# 0.9999, which are tuned for 400K steps at batch 256.
RECIPE = dict(vae="none", learning_rate=2e-3, warmup_steps=100, ema_decay=0.99, num_workers=0,
              checkpoints_total_limit=1, log_every=100, report_to="none")


def _check_settings(folder: Path, settings: dict[str, Any]) -> None:
    """Finished stages are reused on a rerun, so a folder holding a demo of other settings is refused."""
    settings = json.loads(json.dumps(settings))  # as the file holds them
    if (folder / SETTINGS).is_file():
        before = read_json(folder / SETTINGS)
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        if changed:
            raise ValueError(f"{folder} holds a demo made with other {', '.join(changed)}; use another output folder "
                             "or the same settings")
    write_json(folder / SETTINGS, settings)


def _data(folder: Path, images_per_class: int, reference_per_class: int, image_size: int, seed: int
          ) -> tuple[Path, Path]:
    """The training images and held-out images of the same classes (another seed, never trained on)."""
    from .data.demo_data import make_demo_dataset

    data, reference = folder / "data", folder / "reference"
    if not data.is_dir():
        make_demo_dataset(data, images_per_class=images_per_class, image_size=image_size, seed=seed)
    if not reference.is_dir():
        make_demo_dataset(reference, images_per_class=reference_per_class, image_size=image_size, seed=seed + 1)
    return data, reference


def _classifier(folder: Path, data: Path, image_size: int, seed: int) -> float:
    """The class-accuracy classifier of the real images; its accuracy on held-out real images."""
    from .evaluation import train_classifier

    if not (folder / "classifier.json").is_file():
        train_classifier(data, folder, image_size=image_size, seed=seed)
    return read_json(folder / "classifier.json")["held_out"]["accuracy"]


def _train(run: Path, preset: str, data: Path, image_size: int, steps: int, batch_size: int, seed: int,
           **options) -> Path:
    """One training run of the demo's recipe; a finished one is kept, a stopped one resumed."""
    from .training import TrainConfig, train

    if (run / "final").is_dir():
        return run / "final"
    return train(TrainConfig(output_dir=str(run), preset=preset, data_dir=str(data), image_size=image_size,
                             max_steps=steps, global_batch_size=batch_size, checkpoint_every=max(1, steps // 3),
                             resume="latest", seed=seed, **RECIPE, **options))


def _features(inception_weights: str | None) -> dict[str, Any]:
    from .evaluation import resolve_inception_weights

    try:
        return {"inception_weights": resolve_inception_weights(inception_weights, download=False)}
    except FileNotFoundError:
        if inception_weights:
            raise
        logger.info("no Inception weights: FID with a random InceptionV3 (NOT comparable to published numbers)")
        return {"random_inception_seed": 0}


def ratio_picture(pipe, ratios: Sequence[float | None], num_inference_steps: int = 25, guidance_scale: float = 3.0,
                  seed: int = 0, scale: int = 6):
    """One row per head activation ratio (None: the trained one), one image of every class per row
    (seed ``seed``), enlarged ``scale`` times (nearest neighbour: the model's own pixels), each row
    labelled with its realised ratio and attention FLOPs against dense."""
    from PIL import Image, ImageDraw

    from .models import model_attention_flops

    classes = list(range(pipe.transformer.config.num_classes))
    rows = []
    for ratio in ratios:
        out = pipe(classes, guidance_scale=guidance_scale, num_inference_steps=num_inference_steps,
                   head_activation_ratio=ratio, seeds=[seed] * len(classes))
        sparse, dense = model_attention_flops(pipe.transformer, ratio=out.head_activation_ratio)
        rows.append((f"ratio {out.head_activation_ratio:.2f}\n{100 * sparse / dense:.0f}% FLOPs", out.images))
    cell, left, top = rows[0][1][0].width * scale, 90, 16
    picture = Image.new("RGB", (left + len(classes) * (cell + 2), top + len(rows) * (cell + 2)), "white")
    draw = ImageDraw.Draw(picture)
    for c in classes:
        draw.text((left + c * (cell + 2) + 2, 2), str(pipe.id2label.get(c, c))[: cell // 6], fill="black")
    for r, (label, images) in enumerate(rows):
        y = top + r * (cell + 2)
        draw.multiline_text((4, y + cell // 2 - 12), label, fill="black")
        for c, image in enumerate(images):
            picture.paste(image.resize((cell, cell), Image.NEAREST), (left + c * (cell + 2), y))
    return picture


def demo(output_dir: str = "demo_output", *, preset: str = "MoH-DiT-Tiny/2", image_size: int = 16,
         images_per_class: int = 300, reference_per_class: int = 30, max_steps: int = 1400, batch_size: int = 32,
         sample_steps: int = 25, sweep_samples: int = 120, ratios: Sequence[float | str] = RATIOS,
         inception_weights: str | None = None, seed: int = 0) -> dict[str, Any]:
    """The whole job into ``output_dir`` (see the module's docstring); returns the sweep's result."""
    settings = {k: v for k, v in locals().items() if k not in ("output_dir", "inception_weights")}
    from .sampling import load_pipeline
    from .sampling.sweep import sweep, table

    start = time.perf_counter()
    with output_folder(output_dir, "demo", resume=True, inputs={"inception_weights": inception_weights},
                       setup=(SETTINGS,)) as out:
        _check_settings(out, settings)
        data, reference = _data(out, images_per_class, reference_per_class, image_size, seed)
        logger.info(f"[1/5] demo dataset: {data} (held-out: {reference})")
        accuracy = _classifier(out / "classifier", data, image_size, seed)
        logger.info(f"[2/5] classifier: {100 * accuracy:.1f}% on held-out real images")
        logger.info(f"[3/5] training {preset} for {max_steps} steps ({image_size} px, pixel space)")
        final = _train(out / "run", preset, data, image_size, max_steps, batch_size, seed)
        pipe = load_pipeline(final)
        pipe.set_progress_bar_config(disable=True)
        low, high = pipe.transformer.head_activation_range
        with atomic_write(out / "ratios.png") as f:
            picture = ratio_picture(pipe, [high, None, low], sample_steps, seed=seed, scale=max(1, 96 // image_size))
            picture.save(f, format="PNG")
        logger.info(f"[4/5] the same seeds at every head, the trained ratio and the fewest: {out / 'ratios.png'}")
        logger.info(f"[5/5] head-activation sweep: {sweep_samples} images per ratio, {sample_steps} steps")
        progress = logger.isEnabledFor(logging.INFO)
        result = sweep(pipe, ratios, reference=reference, output_dir=out / "sweep", overwrite=True,
                       num_samples=sweep_samples, batch_size=60, num_inference_steps=sample_steps, seed=seed,
                       classifier=out / "classifier", cache_dir=out / "cache", head_usage_images=2, progress=progress,
                       **_features(inception_weights))
        logger.info(table(result))
        write_json(out / "demo_summary.json", {"minutes": (time.perf_counter() - start) / 60, "model": str(final),
                                               "classifier_held_out_accuracy": accuracy, "rows": result["rows"]})
    logger.info(f"done in {(time.perf_counter() - start) / 60:.1f} min: {out / 'ratios.png'}, {out / 'sweep'}")
    return result


DENSE, UPCYCLED = "DiT-Tiny/2", "MoH-DiT-Tiny/2-up75"


def upcycle_demo(output_dir: str = "upcycle_demo", *, dense_steps: int = 900, continue_steps: int = 300,
                 router_warmup_steps: int = 30, images_per_class: int = 300, reference_per_class: int = 30,
                 batch_size: int = 32, eval_samples: int = 120, sample_steps: int = 25,
                 inception_weights: str | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Upcycling against training from scratch into ``output_dir`` (see the module's docstring);
    returns a row of metrics per model, also written as ``upcycle_demo.md`` and ``.json``."""
    settings = {k: v for k, v in locals().items() if k not in ("output_dir", "inception_weights")}
    from .hub.upcycle import upcycle
    from .sampling.sweep import sweep

    n, m, size = dense_steps, continue_steps, 16
    with output_folder(output_dir, "upcycle-demo", resume=True, inputs={"inception_weights": inception_weights},
                       setup=(SETTINGS,)) as out:
        _check_settings(out, settings)
        data, reference = _data(out, images_per_class, reference_per_class, size, seed)
        logger.info(f"[1/4] dense {DENSE}: {n} steps")
        dense = _train(out / "dense", DENSE, data, size, n, batch_size, seed)
        logger.info(f"[2/4] upcycled to {UPCYCLED}, then {m} steps ({router_warmup_steps} routers only)")
        upcycled = out / "upcycled"
        if not upcycled.is_dir():
            upcycle(dense, 0.75, calibration=data, batch_size=32, seed=seed, progress=False, output_dir=upcycled)
        continued = _train(out / "upcycled_run", UPCYCLED, data, size, m, batch_size, seed, init_from=str(upcycled),
                           router_warmup_steps=router_warmup_steps)
        logger.info(f"[3/4] baselines: {DENSE} continued {m} steps; {UPCYCLED} from scratch, {n + m} steps")
        dense_more = _train(out / "dense_continued", DENSE, data, size, m, batch_size, seed, init_from=str(dense))
        scratch = _train(out / "scratch", UPCYCLED, data, size, n + m, batch_size, seed)
        accuracy = _classifier(out / "classifier", data, size, seed)
        logger.info(f"[4/4] metrics: {eval_samples} images per model, {sample_steps} steps")
        features, rows = _features(inception_weights), []
        models = ((f"dense {DENSE}", n, dense), (f"dense {DENSE}, continued", n + m, dense_more),
                  ("upcycled, before training", n, upcycled), ("upcycled, continued", n + m, continued),
                  (f"{UPCYCLED} from scratch", n + m, scratch))
        for name, steps, model in models:
            row = sweep(model, ["trained"], reference=reference, num_samples=eval_samples, batch_size=60,
                        num_inference_steps=sample_steps, seed=seed, classifier=out / "classifier",
                        cache_dir=out / "cache", bootstrap=0, progress=False, **features)["rows"][0]
            rows.append({"model": name, "training_steps": steps, "head_activation": row["realised_ratio"],
                         **{k: row[k] for k in ("fid", "sfid", "precision", "recall", "class_accuracy")}})
        lines = [f"{eval_samples} images per model, {sample_steps} DDPM steps, guidance 1.5, the same seeds and "
                 f"labels; the classifier scores {accuracy:.3f} on held-out real images (chance 1/12).", "",
                 "| model | training steps | head activation | FID | sFID | precision | recall | class accuracy |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['training_steps']} | {r['head_activation']:.3f} | {r['fid']:.2f} | "
                  f"{r['sfid']:.2f} | {r['precision']:.3f} | {r['recall']:.3f} | {r['class_accuracy']:.3f} |"
                  for r in rows]
        with atomic_write(out / "upcycle_demo.md", "w") as f:
            f.write("\n".join(lines) + "\n")
        write_json(out / "upcycle_demo.json", {"classifier_held_out_accuracy": accuracy, "rows": rows,
                                               "features": next(iter(features))})
    logger.info("\n".join(lines))
    return rows
