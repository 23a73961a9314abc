"""Write the demo dataset: 12 classes of coloured shapes, 32x32 PNGs, ImageFolder layout.

    moh-dit make-demo-dataset --output-dir data/shapes
"""

from __future__ import annotations

import argparse
import sys
import time

from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, command, run_cli
from moh_dit.data.demo_data import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE, demo_classes, make_demo_dataset
from moh_dit.utils.logging import get_logger

logger = get_logger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True, help="folder to create (must not exist unless --overwrite)")
    parser.add_argument("--images-per-class", type=int, default=300, help="images in each of the 12 classes")
    parser.add_argument("--image-size", type=int, default=32,
                        help=f"square image side in pixels ({MIN_IMAGE_SIZE} to {MAX_IMAGE_SIZE})")
    parser.add_argument("--seed", type=int, default=0, help="image i of class c depends only on (seed, c, i); >= 0")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier demo dataset at --output-dir (never a folder this command did not write)")
    return parser.parse_args(argv)


@command
def main(args: argparse.Namespace) -> None:
    # make_demo_dataset checks every value (--images-per-class >= 1, --image-size within
    # MIN_IMAGE_SIZE..MAX_IMAGE_SIZE, --seed >= 0, --output-dir) before it writes anything.
    start = time.perf_counter()
    path = make_demo_dataset(
        args.output_dir,
        images_per_class=args.images_per_class,
        image_size=args.image_size,
        seed=args.seed,
        overwrite=args.overwrite,
    )
    n = len(demo_classes())
    logger.info(
        f"wrote {n * args.images_per_class} images ({n} classes x {args.images_per_class}, "
        f"{args.image_size}x{args.image_size}) to {path} in {time.perf_counter() - start:.1f}s"
    )


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    sys.exit(cli())
