"""``moh-dit train-classifier --data-dir DIR --output-dir CLF_DIR``, then ``moh-dit evaluate ... --classifier
CLF_DIR``: classes follow the sorted folder names of DIR, as training does; the accuracy on a seeded
held-out fraction of each class bounds what class accuracy can show."""

from __future__ import annotations

import argparse

from . import float_range, int_range

DESCRIPTION = "train the small classifier behind class accuracy"


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", "--data_dir", dest="data_dir", required=True,
                        help="real images, one folder per class")
    parser.add_argument("--output-dir", "--output_dir", "--output", dest="output_dir", required=True,
                        help="the classifier folder to write (built aside and renamed into place)")
    parser.add_argument("--image-size", type=int_range(8, 1024), default=32,
                        help="images are centre-cropped and resized to this (samples too)")
    parser.add_argument("--epochs", type=int_range(1), default=4)
    parser.add_argument("--batch-size", type=int_range(1, 65536), default=64)
    parser.add_argument("--learning-rate", type=float_range(0, above=True), default=3e-3)
    parser.add_argument("--width", type=int_range(1, 1024), default=16, help="channels of the first stage")
    parser.add_argument("--held-out-fraction", type=float_range(0, 1, above=True), default=0.1,
                        help="of each class, kept out of training")
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
