"""moh-dit make-demo-dataset: the demo's data, 12 classes of coloured shapes as an image folder.

    moh-dit make-demo-dataset --output-dir data/shapes
"""

from __future__ import annotations

import argparse

from moh_dit.commands.train import int_range
from moh_dit.data.demo_data import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE

DESCRIPTION = "draw the demo's dataset of shapes"


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-dir", "--output_dir", "--output", dest="output_dir", required=True,
                        help="the folder to create")
    parser.add_argument("--images-per-class", type=int_range(1, 100_000), default=300,
                        help="images in each of the 12 classes")
    parser.add_argument("--image-size", type=int_range(MIN_IMAGE_SIZE, MAX_IMAGE_SIZE), default=32,
                        help=f"square image side in pixels ({MIN_IMAGE_SIZE} to {MAX_IMAGE_SIZE})")
    parser.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0,
                        help="image i of class c depends on (seed, c, i)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier demo dataset at --output-dir")


def main(args: argparse.Namespace) -> None:
    from moh_dit.data.demo_data import make_demo_dataset

    path = make_demo_dataset(args.output_dir, images_per_class=args.images_per_class, image_size=args.image_size,
                             seed=args.seed, overwrite=args.overwrite)
    print(f"wrote {12 * args.images_per_class} images ({args.image_size}x{args.image_size}) to {path}")
