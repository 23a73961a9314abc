"""``moh-dit upcycle``: a dense DiT as a MoH-DiT that keeps every dense weight.

    moh-dit upcycle --checkpoint DiT-XL-2-256x256.pt --preset DiT-XL/2 --output-dir dit-xl-2-up75 \\
        --activation 0.75 --calibration-data imagenet256_latents --calibration-batches 8 --device cuda
    moh-dit upcycle --checkpoint runs/dense/final --output-dir up --shared-heads 4,2,2,1,2,0 --top-k 0,1,1,2,1,2

Then continue training with ``moh-dit train --init-from OUTPUT_DIR [--router-warmup-steps N]``.
"""

from __future__ import annotations

import argparse

from . import int_range

DESCRIPTION = "turn a dense DiT into a MoH-DiT (head importance, head choice, weight transfer)"


def _activation(text: str) -> float:
    if not 0 < float(text) <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text}: give a head activation in (0, 1]")
    return float(text)


def _per_layer(text: str) -> int | list[int]:
    """``3`` (every layer) or ``4,2,2,1,2,0`` (one per layer)."""
    values = [int(v) for v in text.split(",")]
    return values[0] if len(values) == 1 else values


def build_parser(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--checkpoint", required=True, help="the dense model: a model or pipeline folder, or what convert reads")
    add("--output-dir", "--output_dir", "--output", dest="output_dir", required=True,
        help="the model folder to write (built aside and renamed into place)")
    add("--preset", default=None, help="the dense DiT preset of a checkpoint that is not a model folder")
    add("--activation", type=_activation, default=None,
        help="head activation: an upcycled preset's layout where one fits, else the upcycling rule's")
    add("--shared-heads", type=_per_layer, default=None, help="shared heads: one number or one per layer")
    add("--top-k", type=_per_layer, default=None, help="routed top-K: one number or one per layer")
    add("--calibration-data", dest="calibration", metavar="DIR", default=None,
        help="an image folder or a latent cache to measure head importance on")
    add("--calibration-batches", dest="calibration_batches_count", metavar="N", type=int_range(1, 10_000), default=4,
        help="batches of calibration data (default: %(default)s)")
    add("--batch-size", type=int_range(1, 4096), default=16, help="calibration batch size (default: %(default)s)")
    add("--vae", default=None, help="the VAE (folder or Hub id) that encodes an image folder")
    add("--weights", choices=["ema", "model"], default="ema", help="which weights of a training checkpoint")
    add("--sample-size", type=int_range(1, 512), default=None, help="latent size of a checkpoint (default: its own)")
    add("--num-classes", type=int_range(1, 100_000), default=None, help="classes of a checkpoint (default: its own)")
    add("--device", default="cpu", help="where importance is measured: cpu, cuda or cuda:N")
    add("--seed", type=int_range(0, 2**63 - 1), default=0, help="seed of the calibration order, timesteps and noise")
    add("--overwrite", action="store_true", help="replace an earlier upcycled model at --output-dir")


def main(args: argparse.Namespace) -> None:
    from moh_dit.hub.upcycle import upcycle

    _, report = upcycle(
        args.checkpoint, args.activation, shared_heads=args.shared_heads, top_k=args.top_k,
        calibration=args.calibration, calibration_batches_count=args.calibration_batches_count,
        batch_size=args.batch_size, preset=args.preset, weights=args.weights, sample_size=args.sample_size,
        num_classes=args.num_classes, vae=args.vae, seed=args.seed, device=args.device, output_dir=args.output_dir,
        overwrite=args.overwrite)
    print(report.table())
    print(f"wrote {args.output_dir}: its config.json holds the layout; continue with moh-dit train --init-from")
