"""See MoH at work in the browser: sample a model at any head activation ratio, with the head usage
beside the images.

    pip install ".[app]"                      # Gradio, once
    moh-dit app --model demo_output/run       # then open http://127.0.0.1:7860
    moh-dit app --model moh-dit-xl-2-90 --vae stabilityai/sd-vae-ft-ema --device cuda

--model is any folder ``moh-dit sample`` takes (a pipeline folder, a run's final/, an export, a
conversion). The page picks classes by name or id, seeds, guidance, steps and a scheduler, and up to
three head activation ratios (or schedules such as linear:0.5:1.0) to compare on the same seeds;
it shows the images, the realised ratio, the attention FLOPs relative to dense, the time and the
head-usage figure of each, and offers them as a zip with their settings. It serves this machine
only (--host 127.0.0.1) unless told otherwise, never a public link unless --share; one
generation runs at a time, and each request is limited to what the model runs in about a minute
here (--max-images, --max-steps to change that). See docs/app.md.
"""

from __future__ import annotations

import argparse
import sys

from moh_dit.commands import command_prog
from moh_dit.utils.cli import EXPECTED_ERRORS, ArgumentParser, command, run_cli
from moh_dit.utils.logging import get_logger

logger = get_logger(__name__)


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an int >= 1 (or leave the flag out for this machine's default)")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a pipeline folder, a run's final/, an export or a save_pretrained transformer folder")
    parser.add_argument("--vae", default=None,
                        help="AutoencoderKL path or Hub id, or 'none' for pixel-space models "
                             "(default: the pipeline folder's own VAE; none for a transformer folder)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to serve on (default 127.0.0.1: this machine only; 0.0.0.0 for every network)")
    parser.add_argument("--port", type=int, default=7860, help="port to serve on (default 7860)")
    parser.add_argument("--share", action="store_true",
                        help="also open a temporary public link through Gradio's share servers (off by default)")
    parser.add_argument("--max-images", type=_at_least_one, default=None,
                        help="images per request, all ratios together (default: what fits about a minute here)")
    parser.add_argument("--max-steps", type=_at_least_one, default=None,
                        help="denoising steps per request (default: what fits about a minute here)")
    return parser.parse_args(argv)


@command
def main(args: argparse.Namespace) -> int:
    from moh_dit.app import require_gradio

    require_gradio()  # before the model loads
    import torch

    from moh_dit.app import AppLimits, build_app, default_limits
    from moh_dit.sampling.sample import check_model_flags, load_pipeline
    from moh_dit.sampling.sweep_results import model_name

    check_model_flags(args.model, args.vae)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pipe = load_pipeline(args.model, vae=args.vae).to(device)
    pipe.set_progress_bar_config(disable=True)
    if args.max_images is None or args.max_steps is None:
        measured = default_limits(pipe)
        limits = AppLimits(args.max_images or measured.max_images, args.max_steps or measured.max_steps)
    else:
        limits = AppLimits(args.max_images, args.max_steps)
    demo = build_app(pipe, title=model_name(args.model), limits=limits)
    logger.info(f"{model_name(args.model)} on {device}: up to {limits.max_images} images and {limits.max_steps} steps "
                f"per request. Serving on http://{args.host}:{args.port} (Ctrl+C to stop).")
    demo.launch(server_name=args.host, server_port=args.port, share=args.share, quiet=True)
    return 0


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr (a missing Gradio too) and a non-zero exit status."""
    return run_cli(main, parse_args, argv, errors=EXPECTED_ERRORS + (ModuleNotFoundError,))


if __name__ == "__main__":
    sys.exit(cli())
