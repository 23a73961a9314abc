"""The whole job on the embedded default, offline, on a CPU:

    moh-dit demo [--output-dir demo_output]

1. writes the demo dataset (12 classes of coloured shapes, 16x16, drawn by the package) and
   a held-out set of the same classes;
2. trains a small CNN classifier on the real images and prints its held-out accuracy (it
   bounds what the class-accuracy metric can show);
3. trains a tiny MoH-DiT (MoH-DiT-Tiny/2: 6 layers, 4 heads, 0.75 head activation, patch 2)
   on the images in pixel space;
4. samples a labelled grid (one row per class) with MoHDiTPipeline, and ratios.png: the same
   seeds and classes at three head activation ratios (all heads, the trained ratio, the
   lowest), one row each, labelled with the ratio and its attention FLOPs relative to dense;
5. runs the head-activation sweep (FID, sFID, IS, precision, recall, class accuracy,
   attention FLOPs, time per ratio) against the held-out images and prints the table.

FID needs a feature network. The standard TF Inception is used when its weights are found
(--inception-weights, MOH_DIT_INCEPTION_WEIGHTS or the torch hub cache); otherwise the demo
says so and uses the same InceptionV3 with a fixed random initialisation, whose numbers only
compare the demo's own ratios and are not comparable to published ones.
Rerunning continues where it stopped (the training resumes from its last checkpoint). The
folder is the demo's own: a rerun continues only a folder moh-dit demo made (it carries the
package's output marker), and any other non-empty folder is refused before anything is written.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from tqdm.auto import tqdm

from moh_dit.evaluation.classifier import load_classifier, train_classifier
from moh_dit.hub.outputs import marked_by
from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, command, run_cli
from moh_dit.utils.io import atomic_write, write_json_atomic
from moh_dit.utils.output_folders import (OUTPUT_MARKER, check_outside_inputs, hold_output_folder,
                                          write_output_marker)
from moh_dit.utils.logging import get_logger, info_enabled
from moh_dit.data.demo_data import make_demo_dataset
from moh_dit.evaluation import InceptionWeightsNotFoundError, resolve_inception_weights
from moh_dit.sampling.sample import load_pipeline
from moh_dit.evaluation.head_usage import measure_head_usage, write_head_usage
from moh_dit.sampling.sweep import run_sweep, write_sweep
from moh_dit.sampling.sweep_results import model_name
from moh_dit.training import TrainConfig, train

logger = get_logger(__name__)


def labelled_grid(pipe, per_class: int, steps: int, guidance_scale: float, seed: int, scale: int = 3) -> Image.Image:
    """One row per class: the class name, then ``per_class`` samples (seeds seed, seed+1, ...),
    each enlarged ``scale`` times (nearest neighbour: the model's own pixels)."""
    names = pipe.id2label
    rows = []
    for class_id in tqdm(sorted(names), desc="sample grid", unit="class", mininterval=1.0, disable=not info_enabled()):
        out = pipe([class_id] * per_class, guidance_scale=guidance_scale, num_inference_steps=steps,
                   seeds=list(range(seed, seed + per_class)), output_type="np")
        rows.append((names[class_id], (out.images * 255).round().astype(np.uint8)))
    size, label_w = rows[0][1].shape[1], 110
    cell = size * scale
    grid = Image.new("RGB", (label_w + per_class * (cell + 2), len(rows) * (cell + 2)), "white")
    draw = ImageDraw.Draw(grid)
    for r, (name, images) in enumerate(rows):
        y = r * (cell + 2)
        draw.text((4, y + cell // 2 - 6), name, fill="black")
        for c, image in enumerate(images):
            tile = Image.fromarray(image).resize((cell, cell), Image.NEAREST)
            grid.paste(tile, (label_w + c * (cell + 2), y))
    return grid


# The rows of ratios.png: every head, the trained ratio, the fewest heads (duplicates dropped).
PICTURE_RATIOS = (1.0, "trained", "min")
RATIOS_PICTURE = "ratios.png"


def ratio_picture(pipe, ratios=PICTURE_RATIOS, steps: int = 25, guidance_scale: float = 3.0, seed: int = 0,
                  scale: int = 3) -> Image.Image:
    """What MoH adds, in one picture: one row per head activation ratio (highest first; ``"trained"``
    and ``"min"`` allowed), one column per class with seed ``seed + column``, the same in every row,
    so that a column shows one image at several costs. Rows are labelled with the realised
    ratio and the attention FLOPs relative to dense (the pipeline's ``mean_attention_flop_ratio``);
    columns with the class names. Samples are enlarged ``scale`` times, nearest neighbour."""
    model = pipe.transformer
    values = {"trained": model.trained_head_activation_ratio, "min": model.head_activation_range[0]}
    wanted = sorted({float(values.get(r, r)) for r in ratios}, reverse=True)
    names = pipe.id2label or {i: str(i) for i in range(model.config.num_classes)}
    classes = sorted(names)
    rows, seen = [], set()
    for ratio in tqdm(wanted, desc="ratio picture", unit="ratio", disable=not info_enabled()):
        out = pipe(classes, guidance_scale=guidance_scale, num_inference_steps=steps, head_activation_ratio=ratio,
                   seeds=[seed + c for c in range(len(classes))], output_type="np", output_head_usage=False)
        if out.head_activation_ratio in seen:  # e.g. "min" of a dense model
            continue
        seen.add(out.head_activation_ratio)
        trained = " (trained)" if abs(out.head_activation_ratio - model.trained_head_activation_ratio) < 1e-9 else ""
        label = f"ratio {out.head_activation_ratio:.2f}{trained}\nattention FLOPs\n{out.mean_attention_flop_ratio:.2f}x dense"
        rows.append((label, (out.images * 255).round().astype(np.uint8)))
    cell, label_w, header = rows[0][1].shape[1] * scale, 130, 16
    picture = Image.new("RGB", (label_w + len(classes) * (cell + 2), header + len(rows) * (cell + 2)), "white")
    draw = ImageDraw.Draw(picture)
    for c, class_id in enumerate(classes):
        draw.text((label_w + c * (cell + 2) + 2, 2), str(names[class_id])[: cell // 6], fill="black")
    for r, (label, images) in enumerate(rows):
        y = header + r * (cell + 2)
        draw.multiline_text((4, y + cell // 2 - 18), label, fill="black")
        for c, image in enumerate(images):
            picture.paste(Image.fromarray(image).resize((cell, cell), Image.NEAREST), (label_w + c * (cell + 2), y))
    return picture


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="demo_output", help="the demo's folder (default: %(default)s)")
    p.add_argument("--preset", default="MoH-DiT-Tiny/2")
    p.add_argument("--image-size", type=int, default=16, help="pixels; the preset's patch size must divide it")
    p.add_argument("--images-per-class", type=int, default=300)
    # A tiny model and a short run: a higher learning rate and a faster EMA than the
    # paper's 1e-4 / 0.9999, which are tuned for 400K steps at batch 256.
    p.add_argument("--max-steps", type=int, default=1400)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--grid-guidance", type=float, default=3.0, help="classifier-free guidance of the grid")
    p.add_argument("--sweep-guidance", type=float, default=1.5,
                   help="classifier-free guidance of the sweep (1 = none; 1.5 is DiT's FID setting)")
    p.add_argument("--sample-steps", type=int, default=25, help="DDPM steps for the grid and the sweep")
    p.add_argument("--sweep-samples", type=int, default=120, help="images per ratio in the sweep")
    p.add_argument("--reference-per-class", type=int, default=30, help="held-out reference images per class")
    p.add_argument("--ratios", default="1.0,0.9,trained,0.6,min")
    p.add_argument("--inception-weights", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Every flag, before the dataset is written or anything is trained; the run itself is unchanged."""
    from moh_dit.models.presets import PRESETS
    from moh_dit.sampling.sweep import parse_ratios

    from moh_dit.data.demo_data import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE

    if args.preset not in PRESETS:
        raise ValueError(f"--preset {args.preset!r} is not a known preset; choose one of {', '.join(PRESETS)}")
    if not MIN_IMAGE_SIZE <= args.image_size <= MAX_IMAGE_SIZE:
        raise ValueError(f"--image-size must be in [{MIN_IMAGE_SIZE}, {MAX_IMAGE_SIZE}], got {args.image_size}")
    patch = PRESETS[args.preset]["patch_size"]
    if args.image_size % patch:
        raise ValueError(f"--image-size {args.image_size} is not divisible by {args.preset}'s patch size {patch}")
    for flag, value, least in (("--images-per-class", args.images_per_class, 1), ("--max-steps", args.max_steps, 1),
                               ("--batch-size", args.batch_size, 1), ("--warmup-steps", args.warmup_steps, 0),
                               ("--sample-steps", args.sample_steps, 1), ("--reference-per-class", args.reference_per_class, 1),
                               ("--sweep-samples", args.sweep_samples, 4), ("--seed", args.seed, 0)):  # fmt: skip
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.sample_steps > 1000:  # the DDPM schedule has 1000 training steps
        raise ValueError(f"--sample-steps must be at most 1000 (the DDPM schedule's length), got {args.sample_steps}")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise ValueError(f"--learning-rate must be a positive finite number, got {args.learning_rate}")
    if not (math.isfinite(args.ema_decay) and 0.0 <= args.ema_decay < 1.0):
        raise ValueError(f"--ema-decay must be in [0, 1), got {args.ema_decay}")
    for flag, value in (("--grid-guidance", args.grid_guidance), ("--sweep-guidance", args.sweep_guidance)):
        if not (math.isfinite(value) and value >= 1.0):
            raise ValueError(f"{flag} must be a finite number >= 1 (1 = no guidance), got {value}")
    parse_ratios(args.ratios)  # raises naming the bad ratio
    if args.inception_weights is not None and not Path(args.inception_weights).expanduser().is_file():
        raise FileNotFoundError(f"--inception-weights {args.inception_weights}: no such file")
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--output-dir {args.output_dir} is a file; choose a folder")


# What a demo folder holds; a folder with these alone (and the demo's dataset) is an earlier
# demo's, from before the output marker.
DEMO_ENTRIES = {"data", "reference", "classifier", "run", "cache", "sweep", "samples_grid.png", RATIOS_PICTURE,
                "demo_summary.json", OUTPUT_MARKER}


def check_demo_folder(out: Path) -> None:
    """Refuse an --output-dir that exists and is not a demo's folder: the demo writes into it in
    place (a rerun continues it), so it must be empty, marked by moh-dit demo, or an earlier
    demo's folder. Writes nothing."""
    if not out.is_dir():
        return
    writer = marked_by(out)
    if writer == "moh-dit demo":
        return
    names = {p.name for p in out.iterdir()}
    hidden = {n for n in names if n.startswith(".")}  # its stages' locks and temporary folders
    earlier = names - hidden <= DEMO_ENTRIES and (out / "data" / "demo_dataset.json").is_file()
    if writer is None and (not names or earlier):
        return
    by = f" ({writer} wrote it)" if writer else ""
    raise FileExistsError(f"--output-dir {out} exists and is not a demo's folder{by}; choose another --output-dir "
                          "(a rerun continues only a folder moh-dit demo made)")


@command
def main(args: argparse.Namespace) -> int:
    check_args(args)
    out = Path(args.output_dir)
    check_outside_inputs(out, {"--inception-weights": args.inception_weights}, "--output-dir")
    check_demo_folder(out)
    with hold_output_folder(out, "demo", "--output-dir"):
        check_demo_folder(out)  # again, as the one writer
        if marked_by(out) is None:
            write_output_marker(out, "demo")
        _run(args, out)
    return 0


def _run(args: argparse.Namespace, out: Path) -> None:
    """The demo's five stages in ``out``; each finished one is kept and skipped on a rerun."""
    start = time.perf_counter()
    data = out / "data"
    reference = out / "reference"  # fresh images of the same classes, never trained on
    size = args.image_size
    if not data.is_dir():
        make_demo_dataset(data, images_per_class=args.images_per_class, image_size=size, seed=args.seed)
    if not reference.is_dir():
        make_demo_dataset(reference, images_per_class=args.reference_per_class, image_size=size, seed=args.seed + 1)
    logger.info(f"[1/5] demo dataset: {data} (held-out reference: {reference})")

    classifier_dir = out / "classifier"
    if not classifier_dir.is_dir():
        logger.info("[2/5] classifier of the real images (for the class accuracy of the samples)")
        train_classifier(data, classifier_dir, image_size=size, seed=args.seed, log=logger.info)
    classifier = load_classifier(classifier_dir)
    logger.info(f"[2/5] classifier: {100 * classifier.held_out_accuracy:.1f}% on held-out real images ({classifier_dir})")

    logger.info(f"[3/5] training {args.preset} for {args.max_steps} steps (pixel space, {size}x{size}, batch {args.batch_size})")
    final = train(TrainConfig(
        preset=args.preset, output_dir=str(out / "run"), data_dir=str(data), vae="none", image_size=size,
        max_steps=args.max_steps, global_batch_size=args.batch_size, learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps, ema_decay=args.ema_decay, checkpoint_every=max(1, args.max_steps // 3), checkpoints_total_limit=1,
        resume="latest", seed=args.seed, num_workers=0, log_every=100, report_to="none",
    ))

    pipe = load_pipeline(final)
    pipe.set_progress_bar_config(disable=True)
    grid = labelled_grid(pipe, per_class=8, steps=args.sample_steps, guidance_scale=args.grid_guidance, seed=args.seed,
                         scale=max(1, 96 // size))
    with atomic_write(out / "samples_grid.png") as f:
        grid.save(f, format="PNG")
    logger.info(f"[4/5] labelled sample grid: {out / 'samples_grid.png'}")
    picture = ratio_picture(pipe, steps=args.sample_steps, guidance_scale=args.grid_guidance, seed=args.seed,
                            scale=max(1, 96 // size))
    with atomic_write(out / RATIOS_PICTURE) as f:
        picture.save(f, format="PNG")
    logger.info(f"[4/5] the same seeds at {', '.join(str(r) for r in PICTURE_RATIOS)} head activation: "
                f"{out / RATIOS_PICTURE}")

    try:
        weights = resolve_inception_weights(args.inception_weights, download=False)
        inception = dict(inception_weights=weights)
    except InceptionWeightsNotFoundError:
        logger.info("      Inception weights not found: using a randomly initialised InceptionV3 "
                    "(numbers NOT comparable to published FIDs).")
        inception = dict(random_inception_seed=0)
    logger.info(f"[5/5] head-activation sweep: {args.sweep_samples} images per ratio, {args.sample_steps} DDPM steps, "
                f"guidance {args.sweep_guidance}")
    result = run_sweep(pipe, args.ratios, reference=reference, num_samples=args.sweep_samples, batch_size=60,
                       num_inference_steps=args.sample_steps, guidance_scale=args.sweep_guidance, seed=args.seed,
                       cache_dir=out / "cache", progress=info_enabled(), log=None, classifier=classifier, **inception)
    files = write_sweep(result, out / "sweep")
    files.update(_head_usage_figure(pipe, out / "sweep" / "head_usage", args, model_name(final)))
    logger.info(result.table())
    trained = next((row for row in result.rows if "trained" in row.requested), None)
    if trained is not None:
        logger.info(f"class accuracy of the samples at the trained ratio: {100 * trained.class_accuracy:.1f}% "
                    f"(the classifier scores {100 * classifier.held_out_accuracy:.1f}% on real images; chance "
                    f"{100 / len(pipe.id2label):.1f}%)")
    minutes = (time.perf_counter() - start) / 60
    write_json_atomic(out / "demo_summary.json", {
        "minutes": minutes, "model": str(final), "classifier": str(classifier_dir),
        "classifier_held_out_accuracy": classifier.held_out_accuracy,
        "class_accuracy": {row.ratio: row.class_accuracy for row in result.rows},
        "ratios_picture": str(out / RATIOS_PICTURE),
        "sweep": {k: str(v) for k, v in files.items()}})
    logger.info(f"done in {minutes:.1f} min: {out / 'samples_grid.png'}, {files['plot']}, {files['csv']}")


def _head_usage_figure(pipe, folder: Path, args: argparse.Namespace, name: str) -> dict[str, Path]:
    """The model's head usage at its trained ratio, 2 images per class (as the sweep command
    draws it): heads per layer, per class and per denoising-step range."""
    usage = measure_head_usage(pipe, images_per_class=2, num_inference_steps=args.sample_steps, seed=args.seed,
                               progress=info_enabled())
    return {"head_usage_" + kind: path for kind, path in write_head_usage(usage, folder, f"{name}: head usage").items()}


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sys.exit(cli())
