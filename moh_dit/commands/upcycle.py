"""Upcycle a dense DiT into a MoH-DiT that keeps every dense weight (docs/upcycling.md).

    moh-dit upcycle --checkpoint DiT-XL-2-256x256.pt --preset DiT-XL/2 --output-dir dit-xl-2-up75 \\
        --activation 0.75 --calibration-data imagenet_latents --calibration-batches 8
    moh-dit upcycle --checkpoint DiT-S-2.pt --preset DiT-S/2 --output-dir dit-s-2-up60 --activation 0.6
    moh-dit upcycle --checkpoint runs/dense/final --output-dir up --shared-heads 4,2,2,1,2,0 --top-k 0,1,1,2,1,2

--checkpoint takes a saved MoHDiTTransformer2DModel folder (a training run's final/) or
anything moh-dit convert reads for a dense preset (then --preset names it).
--activation R takes any head activation from one active head per layer (layers / heads) to
1.0 (every head shared: the dense function). Where an upcycled preset fits the model at R
(MoH-DiT-XL/2-up75, -up90, the tiny ones) its layout is used; otherwise the upcycling rule's
(docs/upcycling.md): the first third of the layers keep every head, later layers route, and the
active heads are the whole number nearest R * heads (ties up). The realised ratio is printed.
Each layer's shared heads are the most important ones on the calibration data (the eps
prediction's change when the head is removed); without --calibration-data heads 0..hs-1 are
shared. Routers start at zero, so the first forward is the dense model with each token's
unselected heads removed. Per layer the choice and the measured importance are printed. The
output folder is written atomically; an existing one is refused, and --overwrite replaces only
an earlier upcycled model (never a folder upcycle did not write). The output's config.json
records the layout (per-layer num_attention_heads, num_shared_heads, top_k). Then continue
training with moh-dit train --init-from OUTPUT_DIR [--router-warmup-steps N] (with --preset
<upcycled preset> where the layout is a preset's).
"""

from __future__ import annotations

import argparse
import sys
import torch

from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, command, run_cli
from moh_dit.hub.outputs import local_path
from moh_dit.hub.upcycle import check_output, save_upcycled, upcycle
from moh_dit.utils.output_folders import check_outside_inputs, hold_output_folder
from moh_dit.utils.logging import get_logger, info_enabled

logger = get_logger(__name__)


def _layers(text: str) -> int | list[int]:
    """``3`` (every layer) or ``4,2,2,1,2,0`` (one per layer)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a comma-separated list of integers") from None
    return values[0] if len(values) == 1 else values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="dense model: a saved model folder, or what moh-dit convert reads")
    p.add_argument("--output-dir", required=True,
                   help="new folder for the MoH model (must not exist, or be empty; see --overwrite)")
    p.add_alias("--output", "--output-dir")
    p.add_argument("--preset", default=None, help="dense preset of a checkpoint that is not a saved model folder (DiT-XL/2, ...)")
    p.add_argument("--activation", type=float, default=None, help="head activation of the MoH model: any value from layers/heads to 1.0 (an upcycled preset's "
                   "layout where one fits, else the upcycling rule's; the realised ratio is printed)")
    p.add_argument("--shared-heads", type=_layers, default=None, help="shared heads: one number, or one per layer")
    p.add_argument("--top-k", type=_layers, default=None, help="routed top-K: one number, or one per layer")
    p.add_argument("--calibration-data", dest="calibration", metavar="CALIBRATION_DATA", default=None,
                   help="ImageFolder or latent cache to measure head importance on")
    p.add_argument("--calibration-batches", dest="calibration_batches_count", metavar="CALIBRATION_BATCHES", type=int,
                   default=4,
                   help="batches of calibration data (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="calibration batch size (default: %(default)s)")
    p.add_argument("--vae", default=None, help="VAE folder or hub id to encode an ImageFolder for a latent model")
    p.add_argument("--weights", choices=["ema", "model"], default="ema", help="which weights of a training checkpoint")
    p.add_argument("--sample-size", type=int, default=None,
                   help="latent size of a checkpoint (32 for 256 px, 64 for 512 px; default: read from it)")
    p.add_argument("--num-classes", type=int, default=None, help="classes of a checkpoint (default: read from it)")
    p.add_argument("--device", default="cpu", help="where importance is measured: cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration order, timesteps and noise")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier upcycled model at --output-dir (never a folder upcycle did not write)")
    return p.parse_args(argv)


@command
def main(args: argparse.Namespace) -> int:
    check_output(args.output_dir, args.overwrite)  # before any loading or measuring
    if args.calibration is None and args.vae is not None:
        raise ValueError("--vae only encodes --calibration-data; give --calibration-data or drop --vae.")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}.")
    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device} but CUDA is not available; use --device cpu.")
    check_outside_inputs(args.output_dir, {"checkpoint": local_path(args.checkpoint), "vae": local_path(args.vae),
                                           "calibration": args.calibration}, "output_dir")
    with hold_output_folder(args.output_dir, "upcycle", "output_dir"):
        _upcycle(args, device)
    return 0


def _upcycle(args: argparse.Namespace, device: torch.device) -> None:
    """The checked command: measure, upcycle, write --output-dir."""
    model, report = upcycle(
        args.checkpoint, args.activation, shared_heads=args.shared_heads, top_k=args.top_k,
        calibration=args.calibration, calibration_batches_count=args.calibration_batches_count,
        batch_size=args.batch_size, preset=args.preset, weights=args.weights, sample_size=args.sample_size,
        num_classes=args.num_classes, vae=args.vae, seed=args.seed, device=device, progress=info_enabled(),
    )
    logger.info(report.table())
    save_upcycled(model, report, args.output_dir, overwrite=args.overwrite)
    params = sum(p.numel() for p in model.parameters())
    logger.info(f"Wrote the upcycled model ({params:,} parameters, head activation {model.head_activation_ratio:.4f}) "
                f"to {args.output_dir}; its config.json records the layout")


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    sys.exit(cli())
