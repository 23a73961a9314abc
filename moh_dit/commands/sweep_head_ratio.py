"""moh-dit sweep: FID, sFID, IS, precision, recall (and class accuracy) against the head activation ratio.

    moh-dit sweep --model runs/b2-75 --ref VIRTUAL_imagenet256_labeled.npz \\
        --ratios trained,1.0,0.9,0.75,0.6,min,linear:0.5:1.0 --num-samples 10000 --output-dir sweeps/b2-75

The same images (class i mod num_classes, seed --seed + i) at every ratio; writes sweep.json,
sweep.csv and fid_vs_ratio.png (FID against mean attention FLOPs, with 95% bootstrap intervals).
"""

from __future__ import annotations

import argparse
import logging

from . import int_range
from .sample import DTYPES

DESCRIPTION = "FID and class accuracy against the head activation ratio"


def ratio_list(text: str) -> list[float | str]:
    """``trained,1.0,0.75,min,linear:0.5:1.0`` -> its items; numbers in (0, 1], the model checks its range."""
    items = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item in ("trained", "min") or item.startswith("linear:"):
            items.append(item)
            continue
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is neither a number, trained, min nor linear:A:B") from None
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"ratio {value} must be in (0, 1]")
        items.append(value)
    if not items:
        raise argparse.ArgumentTypeError("no ratios given")
    return items


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a pipeline folder, a training run folder (its final/) or a transformer folder")
    parser.add_argument("--ref", required=True, help="ADM reference batch .npz, statistics .npz, or real images "
                        "(.npz or folder)")
    parser.add_argument("--ratios", type=ratio_list, default="trained,1.0,0.9,0.75,0.6,min",
                        help="comma-separated ratios in (0, 1], trained, min and linear:A:B (default: %(default)s)")
    parser.add_argument("--output-dir", "--output_dir", "--output", dest="output_dir", default="head_ratio_sweep")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier moh-dit sweep folder")
    parser.add_argument("--num-samples", type=int_range(4, 1_000_000), default=50_000, help="images per ratio")
    parser.add_argument("--batch-size", type=int_range(1, 4096), default=32, help="images per sampling batch")
    parser.add_argument("--eval-batch-size", type=int_range(1, 4096), default=64, help="images per Inception pass")
    parser.add_argument("--num-inference-steps", type=int_range(1, 10_000), default=250)
    parser.add_argument("--guidance-scale", type=float, default=1.5, help="classifier-free guidance; 1 = none")
    parser.add_argument("--guidance-channels", choices=("dit", "all"), default="dit")
    parser.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0, help="image i uses seed + i")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--inception-weights", help="torch-fidelity's weights-inception-2015-12-05-6726825d.pth")
    weights.add_argument("--random-inception-seed", type=int_range(0, 2**63 - 1),
                         help="a random Inception (offline demos only: NOT comparable to published numbers)")
    parser.add_argument("--no-download", action="store_true", help="never download the Inception weights")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--vae", help="AutoencoderKL path or Hub id, or 'none' (default: the pipeline folder's own)")
    parser.add_argument("--scheduler", choices=("ddpm", "ddim", "dpm", "saved"), default="ddpm",
                        help="ddpm: the paper's learned-variance DDPM; saved: a pipeline folder's own")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="transformer dtype")
    parser.add_argument("--attention", choices=("masked", "sparse"), default="masked",
                        help="sparse: skip unselected heads (the opt-in head-sparse path; wall time only)")
    parser.add_argument("--save-samples", action="store_true", help="also write each ratio's PNGs to ratio_X/samples/")
    parser.add_argument("--cache-dir", help="reference statistics cache (default: $MOH_DIT_CACHE or ~/.cache/moh-dit)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the reference cache")
    parser.add_argument("--classifier", help="add class accuracy: a train-classifier folder or torchvision:NAME")
    parser.add_argument("--classifier-weights", help="local weights for a torchvision:NAME classifier")
    parser.add_argument("--bootstrap", type=int_range(0, 100_000), default=200,
                        help="resamples of the FID bootstrap interval (0: none)")
    parser.add_argument("--head-usage-images", type=int_range(0, 1000), default=2,
                        help="images per class for the head-usage figure in OUTPUT_DIR/head_usage/ (0: none)")


def main(args: argparse.Namespace) -> None:
    import torch

    from moh_dit.sampling.sweep import sweep, table

    result = sweep(
        args.model, args.ratios, reference=args.ref, output_dir=args.output_dir, overwrite=args.overwrite,
        num_samples=args.num_samples, batch_size=args.batch_size, num_inference_steps=args.num_inference_steps,
        guidance_scale=args.guidance_scale, guidance_channels=args.guidance_channels, seed=args.seed, vae=args.vae,
        scheduler=None if args.scheduler == "saved" else args.scheduler, dtype=getattr(torch, args.dtype),
        device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        sparse_attention=args.attention == "sparse", inception_weights=args.inception_weights,
        random_inception_seed=args.random_inception_seed, download=not args.no_download,
        eval_batch_size=args.eval_batch_size, cache_dir=args.cache_dir, use_cache=not args.no_cache,
        classifier=args.classifier, classifier_weights=args.classifier_weights, bootstrap=args.bootstrap,
        save_samples=args.save_samples, head_usage_images=args.head_usage_images,
        progress=args.log_level <= logging.INFO)
    if args.log_level <= logging.INFO:
        print(table(result))
