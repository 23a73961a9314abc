"""``moh-dit export``: a trained MoH-DiT as a pipeline folder that carries its own code, with a model card.

    moh-dit export --model runs/b2-75 --vae stabilityai/sd-vae-ft-ema --output-dir exports/moh-dit-b2-75 \\
        --variant bf16 --metrics b2-75.json --sweep sweep/b2-75 --push-to-hub your-name/moh-dit-b2-75

The folder loads with ``DiffusionPipeline.from_pretrained(DIR, trust_remote_code=True)`` without
moh-dit, and with ``MoHDiTPipeline.from_pretrained(DIR)``; ``--app`` makes it a Gradio Space too.
"""

from __future__ import annotations

import argparse

DESCRIPTION = "write (and push) a diffusers pipeline folder that carries its own code, with a model card"


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a training run folder, its final/, a pipeline folder or a model folder")
    parser.add_argument("--vae", default=None,
                        help="AutoencoderKL folder or Hub id, or 'none' (default: a pipeline folder's own)")
    parser.add_argument("--output-dir", "--output_dir", "--output", dest="output_dir", required=True,
                        help="the folder to write (built aside and renamed into place)")
    parser.add_argument("--push-to-hub", "--push_to_hub", dest="push_to_hub", default=None, metavar="REPO_ID",
                        help="upload the finished folder to this Hub model repository")
    parser.add_argument("--private", action="store_true", help="create the Hub repository as private")
    parser.add_argument("--variant", choices=["fp16", "bf16"], default=None,
                        help="also write half-precision weights under diffusers' variant names")
    parser.add_argument("--metrics", default=None, help="moh-dit evaluate's JSON result, for the model card")
    parser.add_argument("--sweep", default=None, help="a head-ratio sweep's folder (sweep.json), for the model card")
    parser.add_argument("--head-usage", default=None,
                        help="moh-dit plot-head-usage's folder: its figure goes into the card (default: the sweep's)")
    parser.add_argument("--license", default="apache-2.0",
                        help="Hub license id for the card (converted DiT weights are cc-by-nc-4.0)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export at --output-dir")
    parser.add_argument("--app", action="store_true", help="also write app.py: the folder runs as a Gradio Space")


def main(args: argparse.Namespace) -> None:
    from moh_dit.hub.export import export_pipeline

    folder = export_pipeline(args.model, args.output_dir, vae=args.vae, variant=args.variant, sweep=args.sweep,
                             metrics=args.metrics, head_usage=args.head_usage, push_to_hub=args.push_to_hub,
                             overwrite=args.overwrite, license=args.license, private=args.private or None, app=args.app)
    print(f"wrote {folder}: DiffusionPipeline.from_pretrained({str(folder)!r}, trust_remote_code=True) loads it"
          + (f"; pushed to https://huggingface.co/{args.push_to_hub}" if args.push_to_hub else ""))

