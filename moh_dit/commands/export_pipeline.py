"""Export a trained MoH-DiT as a self-contained diffusers pipeline folder, with a model card,
and optionally push it to the Hugging Face Hub.

    moh-dit export --model runs/tiny --output-dir exports/moh-dit-tiny
    moh-dit export --model moh-dit-xl-2-90 --vae stabilityai/sd-vae-ft-ema \\
        --output-dir exports/moh-dit-xl-2-90 --variant bf16 --metrics xl-90.json --sweep sweep/xl-90 \\
        --push-to-hub your-name/moh-dit-xl-2-90

The folder loads with diffusers alone:
``DiffusionPipeline.from_pretrained(DIR, trust_remote_code=True)``; with moh-dit installed
also with ``MoHDiTPipeline.from_pretrained(DIR)``. Every flag is checked before any work; a
bad one is refused with one error line and nothing written.
"""

from __future__ import annotations

import argparse
import sys

from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, EXPECTED_ERRORS, command, run_cli
from moh_dit.hub.export import VARIANTS, HubPushError, export_pipeline
from moh_dit.utils.logging import get_logger, info_enabled

logger = get_logger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a training run folder (its final/ and train_config.json), a final/ folder, a pipeline "
                             "folder or a save_pretrained transformer folder")
    parser.add_argument("--vae", default=None,
                        help="AutoencoderKL folder or Hub id, or 'none' (default: a pipeline folder's own -- a run's, "
                             "for a run folder; a latent transformer folder needs one)")
    parser.add_argument("--output-dir", required=True,
                        help="the folder to write (built aside and renamed when complete)")
    parser.add_alias("--output", "--output-dir")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO_ID",
                        help="upload the finished folder to this Hub model repository (name or org/name)")
    parser.add_argument("--private", action="store_true", help="create the Hub repository as private")
    parser.add_argument("--variant", choices=list(VARIANTS), default=None,
                        help="also write half-precision weights under diffusers' variant names")
    parser.add_argument("--sweep", default=None, help="a head-ratio sweep's output folder (sweep.json) for the card")
    parser.add_argument("--metrics", default=None, help="moh-dit evaluate's JSON result for the card")
    parser.add_argument("--head-usage", default=None,
                        help="moh-dit plot-head-usage's output folder: its figure and per-layer loads go into the card "
                             "(default: --sweep's head_usage/, when the sweep drew one)")
    parser.add_argument("--license", default="apache-2.0",
                        help="Hub license id for the card (default apache-2.0; converted DiT weights are cc-by-nc-4.0)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in --output-dir")
    parser.add_argument("--app", action="store_true",
                        help="also write app.py (and its code): the folder runs as a Gradio app and a Hugging Face "
                             "Space (docs/app.md)")
    return parser.parse_args(argv)


@command
def main(args: argparse.Namespace) -> int:
    folder = export_pipeline(
        args.model, args.output_dir, vae=args.vae, variant=args.variant, sweep=args.sweep, metrics=args.metrics,
        head_usage=args.head_usage, push_to_hub=args.push_to_hub, overwrite=args.overwrite, license=args.license,
        private=True if args.private else None, progress=info_enabled(), app=args.app,
    )
    logger.info(f"Wrote {folder}: load it with DiffusionPipeline.from_pretrained({str(folder)!r}, trust_remote_code=True)")
    if args.push_to_hub:
        logger.info(f"Pushed to https://huggingface.co/{args.push_to_hub}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv, errors=EXPECTED_ERRORS + (HubPushError,))


if __name__ == "__main__":
    sys.exit(cli())
