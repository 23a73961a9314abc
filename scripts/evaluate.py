"""Evaluate samples against a reference with ADM's metrics: FID, sFID, Inception Score, precision, recall.

    python scripts/evaluate.py --samples samples.npz --ref VIRTUAL_imagenet256_labeled.npz \
        --inception-weights weights-inception-2015-12-05-6726825d.pth --output results.json

``--samples``: an ``.npz`` with ``arr_0`` uint8 (N, H, W, 3) (as DiT's sample script writes it;
streamed, never loaded whole) or a folder of images. ``--ref``: ADM's reference batch
(``mu``, ``sigma``, ``mu_s``, ``sigma_s``, ``arr_0``) or a folder / ``.npz`` of real images, whose
statistics are computed once and cached. The numbers match ADM's TensorFlow evaluator when the
published Inception weights are used; the JSON says whether they were.
All the work is done by :func:`moh_dit.evaluation.evaluate`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from moh_dit.cli import run_cli
from moh_dit.evaluation import ADM_SPLIT_SIZE, INCEPTION_WEIGHTS_ENV, evaluate
from moh_dit.io_utils import write_json_atomic


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", required=True, help="sample .npz (arr_0, uint8 NHWC) or image folder")
    parser.add_argument("--ref", required=True, help="ADM reference batch .npz, or image .npz/folder of real images")
    parser.add_argument(
        "--inception-weights",
        default=None,
        help=f"InceptionV3 weights file (default: ${INCEPTION_WEIGHTS_ENV}, then the torch hub cache, then a download)",
    )
    parser.add_argument("--output", default=None, help="write the results here as JSON (atomically)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per Inception forward pass")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--num-workers", type=int, default=4, help="image decoding workers for folders")
    parser.add_argument(
        "--cache-dir", default=None, help="reference statistics cache (default ~/.cache/moh_dit/reference_stats)"
    )
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the reference statistics cache")
    parser.add_argument("--no-download", action="store_true", help="never try to download the Inception weights")
    parser.add_argument(
        "--split-size", type=int, default=ADM_SPLIT_SIZE, help="Inception Score split size (ADM: 5000; keep it to compare)"
    )
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> dict:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {args.num_workers}")
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device} but CUDA is not available; use --device cpu")
    if args.output is not None and not Path(args.output).resolve().parent.is_dir():
        raise FileNotFoundError(f"--output folder does not exist: {Path(args.output).resolve().parent}")
    result = evaluate(
        args.samples,
        args.ref,
        inception_weights=args.inception_weights,
        download=not args.no_download,
        device=args.device,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        cache_dir=args.cache_dir,
        use_cache=not args.no_cache,
        split_size=args.split_size,
        progress=True,
    )
    payload = result.to_dict()
    print(json.dumps(payload, indent=2))
    if args.output is not None:
        write_json_atomic(args.output, payload)
    return payload


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    sys.exit(cli())
