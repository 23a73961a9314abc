"""``moh-dit train-classifier``: a small CNN on your real images, to measure the class accuracy of samples.

    moh-dit train-classifier --data-dir DIR --output-dir CLF_DIR
    moh-dit evaluate --samples samples.npz --ref REF --classifier CLF_DIR --output metrics.json

``--data-dir`` holds one folder per class; class indices follow the sorted folder names, as
training does. The accuracy on a seeded held-out fraction of each class bounds what the
metric can show; it is printed and written to ``CLF_DIR/classifier.json``.
"""

from __future__ import annotations

import argparse
import math

from moh_dit.commands.evaluate import int_range

DESCRIPTION = "train the small classifier behind class accuracy"


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def learning_rate(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", "--data_dir", required=True, help="real images, one folder per class")
    parser.add_argument("--output-dir", "--output_dir", "--output", dest="output_dir", required=True,
                        help="the classifier folder to write (built aside and renamed into place)")
    parser.add_argument("--image-size", type=int_range(8, 1024), default=32,
                        help="images are centre-cropped and resized to this (samples too)")
    parser.add_argument("--epochs", type=int_range(1), default=4)
    parser.add_argument("--batch-size", type=int_range(1, 65536), default=64)
    parser.add_argument("--learning-rate", type=learning_rate, default=3e-3)
    parser.add_argument("--width", type=int_range(1, 1024), default=16, help="first stage's channels (then 2x, 4x)")
    parser.add_argument("--held-out-fraction", type=fraction, default=0.1, help="of each class, kept out of training")
    parser.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier classifier at --output-dir")


def main(args: argparse.Namespace) -> None:
    from moh_dit.evaluation import train_classifier

    record = train_classifier(args.data_dir, args.output_dir, image_size=args.image_size, epochs=args.epochs,
                              batch_size=args.batch_size, learning_rate=args.learning_rate,
                              held_out_fraction=args.held_out_fraction, width=args.width, seed=args.seed,
                              overwrite=args.overwrite)
    held = record["held_out"]
    accuracy = "not measured" if held["accuracy"] is None else f"{100 * held['accuracy']:.1f}%"
    print(f"classifier: {accuracy} on {held['count']} held-out real images ({len(record['classes'])} classes) "
          f"-> {args.output_dir}")


def cli(argv=None) -> int:  # TEMPORARY: until the dispatcher builds the parser itself
    import sys

    parser = argparse.ArgumentParser(prog="moh-dit train-classifier", description=DESCRIPTION)
    build_parser(parser)
    args = parser.parse_args(argv)
    try:
        main(args)
    except Exception as error:  # noqa: BLE001
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
