"""moh-dit train: a MoH-DiT or dense DiT with DiT's recipe, on one device or an accelerate launch.

    moh-dit train --preset MoH-DiT-Tiny --data-dir demo_data --vae none --image-size 32 \\
        --output-dir runs/demo --max-steps 1500 --global-batch-size 32 --ema-warmup
    accelerate launch --multi_gpu -m moh_dit.commands train --preset MoH-DiT-XL/2-90 \\
        --latents-dir imagenet_latents --output-dir runs/xl --global-batch-size 256

To resume, run `moh-dit train --output-dir RUN --resume latest`: every flag not given is the
run's (train_config.json). diffusers' example-script spellings work too (--train_data_dir,
--resolution, --train_batch_size, --max_train_steps, --checkpointing_steps, ...).
"""

from __future__ import annotations

import argparse
import logging
import math
import os

from moh_dit.models.presets import PRESETS

from . import float_range, int_range

DESCRIPTION = "train a MoH-DiT or DiT on an image folder or a latent cache"


WORKERS = int_range(0, os.cpu_count() or 1)


def build_parser(parser: argparse.ArgumentParser) -> None:
    # Nothing has a parser default: a flag left out is TrainConfig's default, or on --resume the run's.
    parser.argument_default = argparse.SUPPRESS
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    add = parser.add_argument
    add("--preset", choices=list(PRESETS), metavar="PRESET",
        help=f"{', '.join(PRESETS)}; optional with --init-from (its architecture) and --resume (the run's)")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--data-dir", "--train_data_dir", dest="data_dir", help="an image folder: <class>/<image>")
    data.add_argument("--latents-dir", help="a latent cache of moh-dit extract-latents (its image size and VAE)")
    add("--vae", help="AutoencoderKL hub id or folder, or 'none' for pixel space (default: stabilityai/sd-vae-ft-ema)")
    add("--vae-subfolder", help="the subfolder of --vae holding the VAE (e.g. 'vae' of a pipeline)")
    add("--image-size", "--resolution", dest="image_size", type=int_range(8, 4096), help="pixels (default: 256)")
    add("--output-dir", "--output_dir", "--output", dest="output_dir", required=True, help="the run folder")
    add("--max-steps", "--max_train_steps", dest="max_steps", type=int_range(1),
        help="optimiser steps (default: 400000)")
    add("--global-batch-size", type=int_range(1, 1 << 20),
        help="images per optimiser step over all processes (default: 256)")
    add("--train-batch-size", "--train_batch_size", dest="train_batch_size", type=int_range(1, 1 << 16),
        help="images per process and forward pass (the global batch is this x processes x accumulation)")
    add("--gradient-accumulation-steps", "--gradient_accumulation_steps", dest="gradient_accumulation_steps",
        type=int_range(1, 1 << 16), help="forward/backward passes per optimiser step (default: 1)")
    add("--learning-rate", "--learning_rate", dest="learning_rate", type=float_range(0, above=True),
        help="AdamW's (default: 1e-4)")
    add("--lr-scheduler", "--lr_scheduler", dest="lr_scheduler", help="diffusers' (default: constant_with_warmup)",
        choices=["constant_with_warmup", "constant", "linear", "cosine", "cosine_with_restarts", "polynomial"])
    add("--warmup-steps", "--lr_warmup_steps", dest="warmup_steps", type=int_range(0), help="of the LR schedule")
    add("--weight-decay", type=float_range(0))
    add("--max-grad-norm", "--max_grad_norm", dest="max_grad_norm", type=float_range(0, above=True),
        help="clip gradients to this norm (default: off, as DiT)")
    add("--checkpoint-every", "--checkpointing_steps", dest="checkpoint_every", type=int_range(1),
        help="steps between checkpoints (default: 50000)")
    add("--checkpoints-total-limit", "--checkpoints_total_limit", dest="checkpoints_total_limit", type=int_range(0),
        help="keep this many newest checkpoints (0: all; default: 2)")
    add("--resume", "--resume_from_checkpoint", dest="resume",
        help="latest, checkpoint-N (step-N) or a checkpoint folder; flags left out are the run's")
    add("--init-from", help="start from the weights of a saved model folder (moh-dit upcycle's, a run's final/)")
    add("--router-warmup-steps", type=int_range(0), help="MoH: train only the routers for the first N steps")
    add("--mixed-precision", "--mixed_precision", dest="mixed_precision", choices=["no", "fp16", "bf16"],
        help="default: accelerate's (accelerate launch --mixed_precision or its config)")
    add("--no-tf32", dest="allow_tf32", action="store_false", help="no TF32 matmuls on Ampere and newer GPUs")
    add("--seed", type=int_range(0, 2**31 - 1))
    add("--lb-coeff", type=float_range(0), help="weight of MoH's load-balance loss (default: 0.01)")
    add("--ema-decay", "--ema_decay", dest="ema_decay", type=float_range(0, 1), help="default: 0.9999, as DiT")
    add("--ema-warmup", action="store_true",
        help="diffusers' EMAModel warm-up: decay min(--ema-decay, 1 - (1 + t / inv_gamma) ** -power) at step t")
    add("--ema-inv-gamma", type=float_range(0, above=True), help="with --ema-warmup (default: 1)")
    add("--ema-power", type=float_range(0, above=True), help="with --ema-warmup (default: 2/3)")
    add("--class-dropout", type=float_range(0, 1), help="label dropout for classifier-free guidance (default: 0.1)")
    add("--gradient-checkpointing", "--gradient_checkpointing", dest="gradient_checkpointing", action="store_true")
    add("--compile", action="store_true", help="torch.compile the transformer (checkpoints are the same)")
    add("--compile-per-block", action="store_true", help="with --compile: each block instead (compiles faster)")
    add("--compile-mode", choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
    add("--num-workers", "--dataloader_num_workers", dest="num_workers", type=WORKERS,
        help=f"data loading processes, at most the CPU count {os.cpu_count()} (default: 4)")
    add("--on-corrupt", choices=["error", "skip"], help="unreadable images: stop naming the file, or skip them")
    add("--no-flip", dest="random_flip", action="store_false", help="no random horizontal flips")
    add("--log-every", type=int_range(1), help="steps between log lines (default: 100)")
    add("--sample-every", type=int_range(0), help="an EMA sample grid every N steps (0: off)")
    add("--sample-steps", type=int_range(1, 1000), help="DDPM steps of the sample grid (default: 50)")
    add("--report-to", "--report_to", dest="report_to", choices=["tensorboard", "wandb", "none"],
        help="experiment tracker (default: tensorboard if installed, else none)")
    add("--dry-run", action="store_true", help="print the resolved configuration and exit")
    parser.argument_default = None


def main(args: argparse.Namespace) -> None:
    import dataclasses
    import json
    from pathlib import Path

    from moh_dit.outputs import read_json
    from moh_dit.training import RUN_RECORD, TrainConfig, train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields}
    base = {}
    if given.get("resume") and (Path(args.output_dir) / RUN_RECORD).is_file():
        # A resume takes the run's settings (what the launch decided aside) unless a flag says otherwise.
        base = {k: v for k, v in read_json(Path(args.output_dir) / RUN_RECORD).items() if k in fields}
        for group in (("data_dir", "latents_dir"), ("global_batch_size", "train_batch_size")):
            if any(k in given for k in group):
                base = {k: v for k, v in base.items() if k not in group}
        base.pop("train_batch_size", None)
    cfg = TrainConfig(**{**base, **given})
    if getattr(args, "dry_run", False):
        print(json.dumps(dataclasses.asdict(cfg.resolved()), indent=2))
        return
    final = train(cfg)
    if os.environ.get("RANK", "0") == "0":
        logging.getLogger(__name__).info(f"EMA model: {final}")
