"""Train a small CNN on your real images, to measure the class accuracy of generated samples.

    moh-dit train-classifier --data-dir DIR --output-dir CLF_DIR
    moh-dit evaluate --samples samples.npz --ref REF --classifier CLF_DIR --output m.json

``--data-dir`` is an ImageFolder (one folder per class); class indices follow the sorted folder
names, as training does, so label ``i`` of a model trained on the same folder is the
classifier's class ``i``. A seeded fraction of every class is held out; the accuracy on those
real images is printed and written to ``CLF_DIR/classifier.json`` -- it bounds what the
class-accuracy metric can show. ``CLF_DIR`` holds ``model.safetensors``, ``classifier.json``
and ``class_index.json`` (the class map), written atomically.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moh_dit.evaluation.classifier import train_classifier
from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, command, run_cli
from moh_dit.utils.logging import get_logger

logger = get_logger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="ImageFolder of real images (root/<class>/<image>)")
    p.add_argument("--output-dir", required=True, help="folder to write the classifier to")
    p.add_alias("--output", "--output-dir")
    p.add_argument("--image-size", type=int, default=32,
                   help="images are centre-cropped and resized to this (the samples are resized the same way)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--width", type=int, default=16, help="channels of the first stage (then 2x, 4x)")
    p.add_argument("--held-out-fraction", type=float, default=0.1, help="fraction of each class kept for the accuracy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing classifier folder")
    return p.parse_args(argv)


@command
def main(args: argparse.Namespace) -> int:
    result = train_classifier(
        args.data_dir, args.output_dir, image_size=args.image_size, epochs=args.epochs, batch_size=args.batch_size,
        learning_rate=args.learning_rate, held_out_fraction=args.held_out_fraction, width=args.width,
        seed=args.seed, overwrite=args.overwrite, log=logger.info,
    )
    worst = min(result.held_out_per_class.items(), key=lambda kv: kv[1], default=None)
    if worst is not None:
        logger.info(f"lowest held-out class accuracy: {worst[0]} {100 * worst[1]:.1f}%")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sys.exit(cli())
