"""Train MoH-DiT or a dense DiT baseline with class-conditional diffusion (DiT's recipe).

One CPU or GPU:   python scripts/train.py --preset MoH-DiT-Tiny --data-dir demo_data --vae none --image-size 32 \
                      --output-dir runs/demo --max-steps 1500 --global-batch-size 32
Many GPUs/nodes:  accelerate launch --multi_gpu --num_processes 8 scripts/train.py --preset MoH-DiT-XL/2-90 \
                      --latents-dir imagenet_latents --output-dir runs/xl --global-batch-size 256
To resume, run the same command again with --resume latest.
From weights:     python scripts/train.py --preset MoH-DiT-XL/2-up75 --init-from dit-xl-2-up75 --router-warmup-steps 2000 \
                      --latents-dir imagenet_latents --output-dir runs/up75   (resume it with --resume latest, without
                      --init-from: the checkpoints hold the weights)

The --output-dir belongs to one run: a second run into it while it trains is refused, and so
is a new run (no --resume) into a folder that holds one. Checkpoints are safetensors and JSON,
checked against their recorded SHA-256 before a resume (see docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moh_dit.utils.cli import EXPECTED_ERRORS, run_cli
from moh_dit.models.presets import PRESETS
from moh_dit.utils.speed import COMPILE_MODES
from moh_dit.training import TrainConfig, TrainingDivergedError, preflight, train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=list(PRESETS), metavar="PRESET",
                   help=f"model preset: {', '.join(PRESETS)}")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-dir", help="ImageFolder: one sub-folder of images per class")
    src.add_argument("--latents-dir", help="latent cache written by scripts/extract_latents.py")
    p.add_argument("--vae", default="stabilityai/sd-vae-ft-ema",
                   help="AutoencoderKL hub id or local folder, or 'none' for pixel space (default: %(default)s)")
    p.add_argument("--vae-subfolder", default=None, help="subfolder of --vae holding the VAE (e.g. 'vae' of a pipeline)")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=400_000)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip gradients to this norm (default: off, as DiT)")
    p.add_argument("--checkpoint-every", type=int, default=50_000)
    p.add_argument("--checkpoints-total-limit", type=int, default=2,
                   help="keep this many newest checkpoints of this run (0: all; default: %(default)s)")
    p.add_argument("--resume", default=None,
                   help="'latest' (the newest intact checkpoint of --output-dir; falls back past damaged ones) "
                        "or a checkpoint folder")
    p.add_argument("--init-from", default=None,
                   help="start a new run from the weights of a saved model folder (scripts/upcycle.py's output, a run's "
                        "final/); new optimiser, EMA starting as a copy of them; not with --resume")
    p.add_argument("--router-warmup-steps", type=int, default=0,
                   help="MoH presets: train only the router parameters for the first N steps (default: %(default)s)")
    p.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    p.add_argument("--no-tf32", action="store_true", help="disable TF32 matmuls on Ampere+ GPUs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lb-coeff", type=float, default=0.01, help="weight of the MoH load-balance loss")
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--class-dropout", type=float, default=0.1, help="label dropout for classifier-free guidance")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the transformer (the first steps take longer while it compiles; checkpoints "
                        "are the same as without it, so a run may resume with or without the flag)")
    p.add_argument("--compile-per-block", action="store_true",
                   help="with --compile: compile each transformer block instead of the whole model (compiles faster)")
    p.add_argument("--compile-mode", choices=list(COMPILE_MODES), default=None,
                   help="with --compile: torch.compile's mode (default: torch's default)")
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--on-corrupt", choices=["error", "skip"], default="error",
                   help="unreadable images: stop with the file name (default) or skip and count them")
    p.add_argument("--no-flip", action="store_true", help="disable random horizontal flips")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--sample-every", type=int, default=0, help="save an EMA sample grid every N steps (0: off)")
    p.add_argument("--sample-steps", type=int, default=50, help="DDPM steps of the monitoring grid")
    p.add_argument("--report-to", choices=["tensorboard", "wandb", "none"], default="tensorboard")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything, print the resolved configuration and exit (writes nothing, takes no lock)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        preset=args.preset, output_dir=args.output_dir, data_dir=args.data_dir, latents_dir=args.latents_dir,
        vae=args.vae, vae_subfolder=args.vae_subfolder, image_size=args.image_size, max_steps=args.max_steps,
        global_batch_size=args.global_batch_size, learning_rate=args.learning_rate, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, max_grad_norm=args.max_grad_norm, checkpoint_every=args.checkpoint_every,
        checkpoints_total_limit=args.checkpoints_total_limit or None, resume=args.resume,
        mixed_precision=args.mixed_precision, allow_tf32=not args.no_tf32, seed=args.seed, lb_coeff=args.lb_coeff,
        ema_decay=args.ema_decay, class_dropout=args.class_dropout, gradient_checkpointing=args.gradient_checkpointing,
        num_workers=args.num_workers, on_corrupt=args.on_corrupt, random_flip=not args.no_flip,
        log_every=args.log_every, sample_every=args.sample_every, sample_steps=args.sample_steps,
        report_to=args.report_to, init_from=args.init_from, router_warmup_steps=args.router_warmup_steps,
        compile=args.compile, compile_per_block=args.compile_per_block, compile_mode=args.compile_mode,
    )


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.dry_run:
        what = preflight(cfg)
        print(json.dumps(cfg.__dict__, indent=2, default=str))
        print(what, file=sys.stderr)
        return 0
    final = train(cfg)
    if os.environ.get("RANK", "0") == "0":  # once, not by every process of a distributed launch
        print(f"Done. EMA model: {final}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv, errors=(*EXPECTED_ERRORS, OSError, TrainingDivergedError))


if __name__ == "__main__":
    sys.exit(cli())
