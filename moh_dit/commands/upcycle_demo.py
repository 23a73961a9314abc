"""moh-dit upcycle-demo: upcycling against training from scratch, at demo scale on a CPU (moh_dit.demo).

    moh-dit upcycle-demo              # writes upcycle_demo/; rerun to continue where it stopped
"""

from __future__ import annotations

import argparse

from . import int_range

DESCRIPTION = "upcycling against training from scratch, at demo scale"


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-dir", "--output_dir", "--output", dest="output_dir", default="upcycle_demo")
    parser.add_argument("--dense-steps", type=int_range(1, 10**6), default=900, help="N: dense steps before upcycling")
    parser.add_argument("--continue-steps", type=int_range(1, 10**6), default=300,
                        help="M: steps after upcycling, and of the baselines")
    parser.add_argument("--router-warmup-steps", type=int_range(0, 10**6), default=30,
                        help="of the M steps, routers only")
    parser.add_argument("--images-per-class", type=int_range(1, 10_000), default=300)
    parser.add_argument("--reference-per-class", type=int_range(1, 10_000), default=30, help="held-out per class")
    parser.add_argument("--eval-samples", type=int_range(4, 100_000), default=120, help="images per model")
    parser.add_argument("--batch-size", type=int_range(1, 4096), default=32, help="images per training step")
    parser.add_argument("--sample-steps", type=int_range(1, 1000), default=25, help="DDPM steps of every sample")
    parser.add_argument("--inception-weights", help="torch-fidelity's weights file (default: a random InceptionV3)")
    parser.add_argument("--seed", type=int_range(0, 2**31 - 1), default=0)


def main(args: argparse.Namespace) -> None:
    from moh_dit.demo import upcycle_demo

    upcycle_demo(**{k: v for k, v in vars(args).items() if k not in ("debug", "log_level")})  # dests are its keywords
