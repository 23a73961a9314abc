"""Encode an ImageFolder dataset with a VAE once into a memory-mapped latent cache.

    moh-dit extract-latents --data-dir /data/imagenet/train \
        --vae stabilityai/sd-vae-ft-ema --image-size 256 --output-dir /data/imagenet256-latents
    # 512 px (the DiT-XL/2 512 models): 64 x 64 x 4 latents
    moh-dit extract-latents --data-dir /data/imagenet/train \
        --vae stabilityai/sd-vae-ft-ema --image-size 512 --output-dir /data/imagenet512-latents

Stores the VAE posterior's mean and std of every image, plain and horizontally flipped,
so training from the cache (moh_dit.data.latents.LatentDataset) sees the same distribution as
training from images. Rerun the same command to resume an interrupted extraction; one
extraction at a time writes an --output-dir, which never lies inside --data-dir. The cache
records the image size and the VAE, which moh-dit train --latents-dir takes from it.
"""

from __future__ import annotations

import argparse
import sys

from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, command, run_cli
from moh_dit.data.latents import extract_latents
from moh_dit.utils.logging import info_enabled


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="ImageFolder root: one subfolder per class")
    parser.add_argument("--vae", required=True, help="AutoencoderKL hub id or local diffusers folder")
    parser.add_argument("--vae-subfolder", default=None, help="subfolder holding the VAE, e.g. 'vae' in a pipeline repo")
    parser.add_argument("--image-size", type=int, default=256, help="ADM centre-crop size (multiple of the VAE factor)")
    parser.add_argument("--output-dir", required=True, help="cache folder to create")
    parser.add_argument("--batch-size", type=int, default=64, help="images per encoder call (each encoded twice)")
    parser.add_argument("--shard-size", type=int, default=8192, help="images per shard file and resume unit")
    parser.add_argument("--num-workers", type=int, default=4, help="image decoding processes")
    parser.add_argument("--device", default=None, help="VAE device; default cuda when available, else cpu")
    parser.add_argument("--on-corrupt", choices=["error", "skip"], default="error", help="unreadable images: stop, or skip and list them")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32", help="storage dtype of mean and std")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing latent cache at --output-dir (kept until the new one is complete)")
    return parser.parse_args(argv)


@command
def main(args: argparse.Namespace) -> None:
    # extract_latents checks every value before any work (the numbers, the device, the data
    # folder's layout, an --output-dir that may not be replaced or lies inside or contains
    # --data-dir or a local --vae folder, a --batch-size that cannot fit in memory), then holds
    # the output folder (a second extraction into it stops at once) and marks the finished cache.
    extract_latents(
        args.data_dir,
        args.vae,
        args.output_dir,
        image_size=args.image_size,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        num_workers=args.num_workers,
        device=args.device,
        vae_subfolder=args.vae_subfolder,
        on_corrupt=args.on_corrupt,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=info_enabled(),
    )


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    sys.exit(cli())
