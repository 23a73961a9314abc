"""Convert a MoH-DiT release / facebookresearch DiT / diffusers DiT checkpoint into a
``MoHDiTTransformer2DModel`` folder (``save_pretrained`` format).

    moh-dit convert --checkpoint 7000000.pt --preset MoH-DiT-XL/2-90 --output-dir moh-dit-xl-2-90
    moh-dit convert --checkpoint DiT-XL-2-256x256.pt --preset DiT-XL/2 --output-dir dit-xl-2
    moh-dit convert --checkpoint facebook/DiT-XL-2-256 --preset DiT-XL/2 --output-dir dit-xl-2
    # 512 px: 64 x 64 latents (read from the checkpoint; --sample-size 64 says it explicitly)
    moh-dit convert --checkpoint DiT-XL-2-512x512.pt --preset DiT-XL/2 --sample-size 64 --output-dir dit-xl-2-512
    moh-dit convert --checkpoint facebook/DiT-XL-2-512 --preset DiT-XL/2 --sample-size 64 --output-dir dit-xl-2-512

An unreadable checkpoint, a wrong preset or a bad --output-dir is refused with one error line
before anything is written. --overwrite replaces only an earlier conversion (a folder marked by
moh-dit convert, or a saved model folder from before the marker), never another folder. The
output never lies inside a checkpoint given as a folder (a diffusers model folder) and never
contains the checkpoint; beside a checkpoint file, as in the examples, is fine.
"""

from __future__ import annotations

import argparse
import sys

from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, command, run_cli
from moh_dit.hub.convert import convert_checkpoint
from moh_dit.models.presets import PRESETS
from moh_dit.utils.logging import get_logger

logger = get_logger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help=".pt/.pth/.safetensors file, diffusers folder, URL or Hub id (only an org/name that is "
                             "not a local path is looked up on the Hub)")
    parser.add_argument("--preset", required=True, choices=list(PRESETS), metavar="PRESET",
                        help="model preset the weights belong to (top-K cannot be read from weights)")
    parser.add_argument("--output-dir", required=True,
                        help="output folder (written atomically; an existing one needs --overwrite, a file is refused)")
    parser.add_alias("--output", "--output-dir")
    parser.add_argument("--weights", choices=["ema", "model"], default="ema",
                        help="which weights of a training checkpoint to take (default: ema, used for sampling)")
    parser.add_argument("--sample-size", type=int, default=None, help="latent size (default: read from the checkpoint)")
    parser.add_argument("--num-classes", type=int, default=None, help="number of classes (default: read from the checkpoint)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier conversion at --output-dir (never a folder convert did not write)")
    parser.add_argument("--allow-divergent-embeddings", action="store_true",
                        help="diffusers input only: fold differing per-block embedders by taking block 0's")
    return parser.parse_args(argv)


@command
def main(args: argparse.Namespace) -> int:
    model = convert_checkpoint(
        args.checkpoint, args.preset, args.output_dir, weights=args.weights, sample_size=args.sample_size,
        num_classes=args.num_classes, overwrite=args.overwrite, allow_divergent_embeddings=args.allow_divergent_embeddings,
    )
    params = sum(p.numel() for p in model.parameters())
    logger.info(f"Wrote {args.preset} ({params:,} parameters, head activation {model.head_activation_ratio:.4f}) "
                f"to {args.output_dir}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    sys.exit(cli())
