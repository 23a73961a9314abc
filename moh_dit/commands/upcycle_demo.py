"""Upcycling at demo scale, in one command on a CPU (docs/upcycling.md):

    moh-dit upcycle-demo [--output-dir upcycle_demo]

1. writes the demo dataset (12 classes of coloured shapes, 16x16, as moh-dit demo) and
   held-out reference images;
2. trains a dense DiT-Tiny/2 (the demo model's size: 16 px, patch 2) for N = --dense-steps steps;
3. upcycles it to MoH-DiT-Tiny/2-up75 (0.75 head activation; shared heads by measured importance
   on the training images) and continues it for M = --continue-steps steps, the routers alone
   for the first --router-warmup-steps;
4. the baselines: the dense model continued for M steps, and a MoH model of the same layout
   trained from scratch for N + M steps;
5. samples every model with the same seeds and labels and prints a table (markdown and JSON)
   of FID, sFID, precision and recall against the held-out images, and class accuracy (a small
   CNN trained on the training images, moh_dit.evaluation.classifier, classifies every sample).

Every training run uses the same optimiser settings, batch and data order. FID needs a feature
network: the standard TF Inception when its weights are found (--inception-weights,
MOH_DIT_INCEPTION_WEIGHTS or the torch hub cache), otherwise a fixed randomly initialised
InceptionV3, whose numbers only compare these models with each other and are labelled so.
Rerunning continues where it stopped (finished stages are kept, a stopped run resumes); it
continues only a folder moh-dit upcycle-demo made with the same settings, and any other
non-empty folder is refused before anything is written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, command, run_cli
from moh_dit.data.demo_data import make_demo_dataset
from moh_dit.hub.outputs import marked_by
from moh_dit.utils.io import atomic_write, write_json_atomic
from moh_dit.utils.output_folders import check_outside_inputs, hold_output_folder, write_output_marker
from moh_dit.utils.logging import get_logger
from moh_dit.training import TrainConfig, find_latest_checkpoint, train

logger = get_logger(__name__)

DENSE, UPCYCLED = "DiT-Tiny/2", "MoH-DiT-Tiny/2-up75"  # the main demo's 16 px, patch 2 recipe
IMAGE_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="upcycle_demo", help="the demo's folder (default: %(default)s)")
    # N and M are kept small so the whole comparison runs on a CPU in one sitting: it costs 2N + 3M
    # training steps, then 5 x --eval-samples images and the reference through the Inception network
    # (the measured time is in docs/results.md).
    p.add_argument("--dense-steps", type=int, default=900, help="N: steps of the dense model before upcycling")
    p.add_argument("--continue-steps", type=int, default=300, help="M: steps after upcycling (and of the baselines)")
    p.add_argument("--router-warmup-steps", type=int, default=30, help="of the M steps, routers only (default: %(default)s)")
    p.add_argument("--images-per-class", type=int, default=300)
    p.add_argument("--reference-per-class", type=int, default=30, help="held-out reference images per class")
    # The settings of moh-dit demo: a tiny model and a short run.
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=100, help="learning-rate warm-up of every run")
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--calibration-batches", type=int, default=4, help="batches of 32 training images for importance")
    p.add_argument("--eval-samples", type=int, default=120, help="images per model for the metrics")
    p.add_argument("--sample-steps", type=int, default=25, help="DDPM steps per image")
    p.add_argument("--guidance", type=float, default=1.5, help="classifier-free guidance of the samples (1 = none)")
    p.add_argument("--classifier-epochs", type=int, default=4,
                   help="epochs of the small CNN that scores class accuracy (trained on the training images)")
    p.add_argument("--inception-weights", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Every flag, before anything is written."""
    for flag, value, least in (("--dense-steps", args.dense_steps, 1), ("--continue-steps", args.continue_steps, 1),
                               ("--router-warmup-steps", args.router_warmup_steps, 0),
                               ("--images-per-class", args.images_per_class, 1),
                               ("--reference-per-class", args.reference_per_class, 1),
                               ("--batch-size", args.batch_size, 1), ("--warmup-steps", args.warmup_steps, 0),
                               ("--calibration-batches", args.calibration_batches, 1),
                               ("--eval-samples", args.eval_samples, 4), ("--sample-steps", args.sample_steps, 1),
                               ("--classifier-epochs", args.classifier_epochs, 1),
                               ("--seed", args.seed, 0)):  # fmt: skip
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.router_warmup_steps > args.continue_steps:
        raise ValueError(f"--router-warmup-steps {args.router_warmup_steps} is more than --continue-steps "
                         f"{args.continue_steps}")
    if args.sample_steps > 1000:
        raise ValueError(f"--sample-steps must be at most 1000 (the DDPM schedule's length), got {args.sample_steps}")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise ValueError(f"--learning-rate must be a positive finite number, got {args.learning_rate}")
    if not (math.isfinite(args.ema_decay) and 0.0 <= args.ema_decay < 1.0):
        raise ValueError(f"--ema-decay must be in [0, 1), got {args.ema_decay}")
    if not (math.isfinite(args.guidance) and args.guidance >= 1.0):
        raise ValueError(f"--guidance must be a finite number >= 1 (1 = no guidance), got {args.guidance}")
    if args.inception_weights is not None and not Path(args.inception_weights).expanduser().is_file():
        raise FileNotFoundError(f"--inception-weights {args.inception_weights}: no such file")
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--output-dir {args.output_dir} is a file; choose a folder")


def _train(args: argparse.Namespace, run: Path, preset: str, data: Path, steps: int, init_from: Path | None = None,
           router_warmup: int = 0) -> Path:
    """One training run with the demo's shared settings; a finished one is kept, a stopped one resumed."""
    if (run / "final").is_dir():
        return run / "final"
    resume = "latest" if init_from is None or find_latest_checkpoint(run) is not None else None
    return train(TrainConfig(
        preset=preset, output_dir=str(run), data_dir=str(data), vae="none", image_size=IMAGE_SIZE, max_steps=steps,
        global_batch_size=args.batch_size, learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
        ema_decay=args.ema_decay, checkpoint_every=max(1, steps // 3), checkpoints_total_limit=1, resume=resume,
        seed=args.seed, num_workers=0, log_every=100, report_to="none",
        init_from=None if resume else (str(init_from) if init_from is not None else None),
        router_warmup_steps=router_warmup,
    ))


def _upcycle(args: argparse.Namespace, dense: Path, data: Path, target: Path) -> Path:
    from moh_dit.hub.upcycle import save_upcycled, upcycle

    if not target.is_dir():
        model, report = upcycle(dense, 0.75, calibration=data, calibration_batches_count=args.calibration_batches,
                                batch_size=32, seed=args.seed, progress=False)
        logger.info(report.table())
        save_upcycled(model, report, target)
    return target


def _inception(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from moh_dit.evaluation import InceptionWeightsNotFoundError, resolve_inception_weights

    try:
        return dict(inception_weights=resolve_inception_weights(args.inception_weights, download=False)), "TF Inception"
    except InceptionWeightsNotFoundError:
        return dict(random_inception_seed=0), "random InceptionV3 (seed 0): NOT comparable to published numbers"


def _classifier(args: argparse.Namespace, data: Path, folder: Path) -> tuple[Path, float]:
    """The class-accuracy classifier (trained once on the training images) and its accuracy on
    held-out real images, the ceiling of the samples' class accuracy."""
    from moh_dit.evaluation.classifier import train_classifier

    if not (folder / "classifier.json").is_file():
        train_classifier(data, folder, image_size=IMAGE_SIZE, epochs=args.classifier_epochs, seed=args.seed, log=None)
    return folder, float(json.loads((folder / "classifier.json").read_text())["held_out"]["accuracy"])


def evaluate_models(args: argparse.Namespace, models: list[tuple[str, int, Path]], reference: Path,
                    cache: Path, classifier: Path) -> tuple[list[dict[str, Any]], str]:
    """Each model sampled with the same seeds and labels (class i mod C for image i), scored
    against the held-out images with the same feature network and classifier."""
    from moh_dit.sampling.sample import load_pipeline
    from moh_dit.sampling.sweep import run_sweep

    inception, network = _inception(args)
    rows = []
    for name, steps, folder in models:
        pipe = load_pipeline(folder)
        pipe.set_progress_bar_config(disable=True)
        result = run_sweep(pipe, ["trained"], reference=reference, num_samples=args.eval_samples, batch_size=60,
                           num_inference_steps=args.sample_steps, guidance_scale=args.guidance, seed=args.seed,
                           cache_dir=cache, progress=False, log=None, classifier=classifier, **inception)
        row = result.rows[0]
        rows.append({"model": name, "training_steps": steps, "head_activation": row.realised_ratio,
                     "fid": row.fid, "sfid": row.sfid, "precision": row.precision, "recall": row.recall,
                     "class_accuracy": row.class_accuracy, "folder": str(folder)})
        logger.info(f"      {name}: FID {row.fid:.2f}, sFID {row.sfid:.2f}, precision {row.precision:.3f}, "
                    f"recall {row.recall:.3f}, class accuracy {row.class_accuracy:.3f}")
    return rows, network


def markdown_table(rows: list[dict[str, Any]], network: str, samples: int, sample_steps: int,
                   classifier_accuracy: float, guidance: float = 1.0) -> str:
    lines = [f"Features: {network}. Class accuracy: a small CNN trained on the training images "
             f"({classifier_accuracy:.3f} on held-out real images; chance 1/12). {samples} images per model, "
             f"{sample_steps} DDPM steps, guidance {guidance}, same seeds and labels for every model.", "",
             "| model | training steps | head activation | FID | sFID | precision | recall | class accuracy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['training_steps']} | {r['head_activation']:.3f} | {r['fid']:.2f} | "
                     f"{r['sfid']:.2f} | {r['precision']:.3f} | {r['recall']:.3f} | {r['class_accuracy']:.3f} |")
    return "\n".join(lines) + "\n"


SETTINGS_FILE = "upcycle_demo_settings.json"


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    # Where the demo is, where the Inception weights are found and how much it prints do not
    # change its results.
    return {k: v for k, v in vars(args).items() if k not in ("output_dir", "inception_weights", "verbosity", "debug")}


def check_claim(args: argparse.Namespace, out: Path) -> None:
    """Refuse an --output-dir that is not empty and not an upcycling demo made with the same
    settings (finished stages are reused, so other settings would mix two demos). Writes nothing."""
    path, writer = out / SETTINGS_FILE, marked_by(out)
    if writer not in (None, "moh-dit upcycle-demo"):
        raise FileExistsError(f"--output-dir {out} exists and is not an upcycling demo ({writer} wrote it); "
                              "choose another folder.")
    if path.is_file():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise ValueError(f"--output-dir {out}: {SETTINGS_FILE} cannot be read ({type(error).__name__}: {error}); "
                             "use another --output-dir.") from None
        settings = _settings(args)
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        if changed:
            raise FileExistsError(f"--output-dir {out} holds a demo made with other settings "
                                  f"({', '.join(changed)}); use another --output-dir or the same flags.")
    elif out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"--output-dir {out} exists and is not an upcycling demo; choose another folder.")


def _claim(args: argparse.Namespace, out: Path) -> None:
    """Check the folder (:func:`check_claim`), then record the settings and mark it as the demo's."""
    check_claim(args, out)
    if not (out / SETTINGS_FILE).is_file():
        write_json_atomic(out / SETTINGS_FILE, _settings(args))
    if marked_by(out) is None:
        write_output_marker(out, "upcycle-demo")


@command
def main(args: argparse.Namespace) -> int:
    check_args(args)
    out = Path(args.output_dir)
    check_outside_inputs(out, {"inception_weights": args.inception_weights}, "output_dir")
    check_claim(args, out)
    with hold_output_folder(out, "upcycle-demo", "output_dir"):
        _claim(args, out)  # checked again, as the one writer
        _run(args, out)
    return 0


def _run(args: argparse.Namespace, out: Path) -> None:
    """The demo's stages in ``out``; each finished one is kept and skipped on a rerun."""
    start = time.perf_counter()
    n, m = args.dense_steps, args.continue_steps
    data, reference = out / "data", out / "reference"  # the reference is never trained on
    if not data.is_dir():
        make_demo_dataset(data, images_per_class=args.images_per_class, image_size=IMAGE_SIZE, seed=args.seed)
    if not reference.is_dir():
        make_demo_dataset(reference, images_per_class=args.reference_per_class, image_size=IMAGE_SIZE,
                          seed=args.seed + 1)
    logger.info(f"[1/5] demo dataset: {data} (held-out reference: {reference})")
    logger.info(f"[2/5] dense {DENSE}: {n} steps")
    dense = _train(args, out / "dense", DENSE, data, n)
    logger.info(f"[3/5] upcycling to {UPCYCLED}, then {m} steps ({args.router_warmup_steps} routers only)")
    upcycled = _upcycle(args, dense, data, out / "upcycled")
    continued = _train(args, out / "upcycled_run", UPCYCLED, data, m, upcycled, args.router_warmup_steps)
    logger.info(f"[4/5] baselines: {DENSE} continued {m} steps; {UPCYCLED} from scratch, {n + m} steps")
    dense_more = _train(args, out / "dense_continued", DENSE, data, m, dense)
    scratch = _train(args, out / "scratch", UPCYCLED, data, n + m)
    classifier, ceiling = _classifier(args, data, out / "classifier")
    logger.info(f"[5/5] metrics: {args.eval_samples} images per model, {args.sample_steps} DDPM steps (classifier: "
                f"{ceiling:.3f} on held-out real images)")
    models = [(f"dense {DENSE}", n, dense), (f"dense {DENSE}, continued", n + m, dense_more),
              ("upcycled, before training", n, upcycled), ("upcycled, continued", n + m, continued),
              (f"{UPCYCLED} from scratch", n + m, scratch)]
    rows, network = evaluate_models(args, models, reference, out / "cache", classifier)
    table = markdown_table(rows, network, args.eval_samples, args.sample_steps, ceiling, args.guidance)
    minutes = (time.perf_counter() - start) / 60
    with atomic_write(out / "upcycle_demo.md", "w") as f:
        f.write(table)
    write_json_atomic(out / "upcycle_demo.json", {
        "features": network, "classifier_held_out_accuracy": ceiling, "rows": rows, "minutes": minutes,
        "settings": {k: v for k, v in vars(args).items() if k not in ("output_dir", "verbosity", "debug")}})
    logger.info(table)
    logger.info(f"done in {minutes:.1f} min: {out / 'upcycle_demo.md'}, {out / 'upcycle_demo.json'}")


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sys.exit(cli())
