"""moh-dit demo: the whole job offline on a CPU, on the shapes the package draws (moh_dit.demo).

    moh-dit demo                      # writes demo_output/; rerun to continue where it stopped
"""

from __future__ import annotations

import argparse

from . import int_range

DESCRIPTION = "the whole job offline on the CPU, on data the package draws"


def build_parser(parser: argparse.ArgumentParser) -> None:
    from moh_dit.models.presets import PRESETS

    parser.add_argument("--output-dir", "--output_dir", "--output", dest="output_dir", default="demo_output")
    parser.add_argument("--preset", choices=PRESETS, default="MoH-DiT-Tiny/2")
    parser.add_argument("--image-size", type=int, choices=[12, 16, 24, 32, 48, 64], default=16, help="pixels")
    parser.add_argument("--images-per-class", type=int_range(1, 10_000), default=300)
    parser.add_argument("--reference-per-class", type=int_range(1, 10_000), default=30, help="held-out per class")
    parser.add_argument("--max-steps", type=int_range(1, 10**6), default=1400, help="training steps")
    parser.add_argument("--batch-size", type=int_range(1, 4096), default=32, help="images per training step")
    parser.add_argument("--sample-steps", type=int_range(1, 1000), default=25, help="DDPM steps of every sample")
    parser.add_argument("--sweep-samples", type=int_range(4, 100_000), default=120, help="images per ratio")
    parser.add_argument("--inception-weights", help="torch-fidelity's weights file (default: a random InceptionV3)")
    parser.add_argument("--seed", type=int_range(0, 2**31 - 1), default=0)


def main(args: argparse.Namespace) -> None:
    from moh_dit.demo import demo

    demo(**{k: v for k, v in vars(args).items() if k not in ("debug", "log_level")})  # dests are its keywords
