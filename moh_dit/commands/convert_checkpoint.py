"""``moh-dit convert``: a release, facebookresearch or diffusers DiT checkpoint as a model folder.

    moh-dit convert --checkpoint 7000000.pt --preset MoH-DiT-XL/2-90 --output-dir moh-dit-xl-2-90
    moh-dit convert --checkpoint facebook/DiT-XL-2-256 --preset DiT-XL/2 --output-dir dit-xl-2
    moh-dit convert --checkpoint DiT-XL-2-512x512.pt --preset DiT-XL/2 --sample-size 64 --output-dir dit-xl-2-512
"""

from __future__ import annotations

import argparse

from . import int_range

DESCRIPTION = "convert the release's, facebookresearch's or diffusers' DiT checkpoints into a model folder"


def build_parser(parser: argparse.ArgumentParser) -> None:
    from moh_dit.models.presets import PRESETS

    parser.add_argument("--checkpoint", required=True,
                        help=".pt/.pth/.safetensors file, diffusers DiT folder, URL or Hub id (org/name)")
    parser.add_argument("--preset", required=True, choices=list(PRESETS), metavar="PRESET",
                        help="the preset the weights belong to (top-K cannot be read from weights)")
    parser.add_argument("--output-dir", "--output_dir", "--output", dest="output_dir", required=True,
                        help="the model folder to write (built aside and renamed into place)")
    parser.add_argument("--weights", choices=["ema", "model"], default="ema",
                        help="which weights of a training checkpoint (default: ema, used for sampling)")
    parser.add_argument("--sample-size", type=int_range(1, 512), default=None,
                        help="latent size: 32 for 256 px, 64 for 512 px (default: read from the checkpoint)")
    parser.add_argument("--num-classes", type=int_range(1, 100_000), default=None,
                        help="number of classes (default: read from the checkpoint)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier conversion at --output-dir")
    parser.add_argument("--allow-divergent-embeddings", action="store_true",
                        help="diffusers input whose per-block embedders differ: take block 0's")


def main(args: argparse.Namespace) -> None:
    from moh_dit.hub.convert import convert_checkpoint

    model = convert_checkpoint(args.checkpoint, args.preset, args.output_dir, weights=args.weights,
                               sample_size=args.sample_size, num_classes=args.num_classes, overwrite=args.overwrite,
                               allow_divergent_embeddings=args.allow_divergent_embeddings)
    print(f"wrote {args.preset} ({sum(p.numel() for p in model.parameters()):,} parameters) to {args.output_dir}")

