"""moh-dit extract-latents: encode an image folder with a VAE once into a latent cache.

    moh-dit extract-latents --data-dir /data/imagenet/train --vae stabilityai/sd-vae-ft-ema \\
        --image-size 256 --output-dir /data/imagenet256-latents

The cache keeps the VAE posterior's mean and std of every image, plain and flipped, so training
on it (moh-dit train --latents-dir) sees DiT's distribution. Run the same command again to
continue an interrupted extraction.
"""

from __future__ import annotations

import argparse

from moh_dit.commands.train import WORKERS, int_range

DESCRIPTION = "encode an image folder into a latent cache"


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("--data-dir", required=True, help="an image folder: <class>/<image>")
    parser.add_argument("--vae", required=True, help="AutoencoderKL hub id or folder")
    parser.add_argument("--vae-subfolder", help="the subfolder holding the VAE, e.g. 'vae' of a pipeline")
    parser.add_argument("--image-size", type=int_range(8, 4096), default=256,
                        help="ADM centre crop, a multiple of the VAE's downsampling (default: 256)")
    parser.add_argument("--output-dir", "--output_dir", "--output", dest="output_dir", required=True,
                        help="the cache folder")
    parser.add_argument("--batch-size", type=int_range(1, 4096), default=64, help="images per encoder call")
    parser.add_argument("--shard-size", type=int_range(1, 1 << 20), default=4096,
                        help="images per shard file, the unit an interrupted extraction resumes by")
    parser.add_argument("--num-workers", type=WORKERS, default=4, help="image decoding processes")
    parser.add_argument("--device", help="the VAE's device (default: cuda when available)")
    parser.add_argument("--on-corrupt", choices=["error", "skip"], default="error",
                        help="unreadable images: stop naming the file, or skip and list them")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32", help="of the stored mean, std")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier latent cache at --output-dir")


def main(args: argparse.Namespace) -> None:
    from moh_dit.data.latents import extract_latents

    extract_latents(args.data_dir, args.vae, args.output_dir, args.image_size, batch_size=args.batch_size,
                    shard_size=args.shard_size, num_workers=args.num_workers, device=args.device,
                    vae_subfolder=args.vae_subfolder, on_corrupt=args.on_corrupt, dtype=args.dtype,
                    overwrite=args.overwrite)
