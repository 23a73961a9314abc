"""moh-dit sample: per-index seeds, balanced labels, PNGs and one ADM .npz, on any number of processes.

    accelerate launch -m moh_dit.commands sample --model moh-dit-xl-2-90 --vae stabilityai/sd-vae-ft-ema \\
        --num-samples 50000 --per-device-batch-size 32 --guidance-scale 1.5 --num-inference-steps 250 \\
        --output-dir samples/xl-90

Image i (class i mod num_classes, seed --seed + i) is the same for any batch size and process
count; to resume, run the same command again.
"""

from __future__ import annotations

import argparse
import logging

from . import int_range

DESCRIPTION = "sample images (PNG folder and ADM .npz) with any number of processes"
DTYPES = ("float32", "bfloat16", "float16")


def ratio(text: str) -> float | str:
    """A head activation ratio: a number, or ``linear:A:B`` (first step to last); the model checks its range."""
    if text.startswith("linear:"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor linear:A:B") from None


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a pipeline folder, a training run folder (its final/) or a transformer folder")
    parser.add_argument("--vae", help="AutoencoderKL path or Hub id, or 'none' (default: the pipeline folder's own)")
    parser.add_argument("--output-dir", "--output_dir", "--output", dest="output_dir", required=True,
                        help="samples/*.png, samples.npz, sample_config.json")
    parser.add_argument("--num-samples", type=int_range(1, 10_000_000), default=50_000)
    parser.add_argument("--per-device-batch-size", type=int_range(1, 4096), default=32, dest="batch_size")
    parser.add_argument("--guidance-scale", type=float, default=1.5, help="classifier-free guidance; 1 = none")
    parser.add_argument("--guidance-channels", choices=("dit", "all"), default="dit",
                        help="dit: the first 3 eps channels, as DiT and the paper; all: as diffusers' DiTPipeline")
    parser.add_argument("--num-inference-steps", type=int_range(1, 10_000), default=250)
    parser.add_argument("--scheduler", choices=("ddpm", "ddim", "dpm", "saved"), default="saved",
                        help="saved: a pipeline folder's own (DDPM for a transformer folder)")
    parser.add_argument("--clip-sample", choices=("auto", "yes", "no"), default="auto",
                        help="with --scheduler ddpm/ddim: clamp predicted x0; auto: yes for pixel-space models")
    parser.add_argument("--head-activation-ratio", type=ratio,
                        help="a ratio, or linear:A:B from the first step to the last (default: the trained one)")
    parser.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0, help="image i uses seed + i")
    parser.add_argument("--class-labels", choices=("balanced", "uniform"), default="balanced",
                        help="balanced: class i mod num_classes; uniform: a draw per index")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="transformer dtype (the VAE stays float32)")
    parser.add_argument("--no-npz", action="store_true", help="write only the PNGs")
    parser.add_argument("--compile", action="store_true", help="torch.compile the transformer")
    parser.add_argument("--compile-mode", help="torch.compile's mode, e.g. reduce-overhead")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier moh-dit sample folder")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved settings and exit")


def main(args: argparse.Namespace) -> None:
    import torch

    from moh_dit.sampling import sample

    sample(args.model, args.output_dir, num_samples=args.num_samples, batch_size=args.batch_size,
           guidance_scale=args.guidance_scale, guidance_channels=args.guidance_channels,
           num_inference_steps=args.num_inference_steps, head_activation_ratio=args.head_activation_ratio,
           seed=args.seed, class_labels=args.class_labels, vae=args.vae,
           scheduler=None if args.scheduler == "saved" else args.scheduler,
           clip_sample={"auto": None, "yes": True, "no": False}[args.clip_sample],
           dtype=getattr(torch, args.dtype), npz=not args.no_npz, compile=args.compile,
           compile_mode=args.compile_mode, overwrite=args.overwrite, dry_run=args.dry_run,
           progress=args.log_level <= logging.INFO)
