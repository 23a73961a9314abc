r"""Train MoH-DiT or a dense DiT baseline with class-conditional diffusion (DiT's recipe).

One CPU or GPU:   moh-dit train --preset MoH-DiT-Tiny --data-dir demo_data --vae none --image-size 32 \
                      --output-dir runs/demo --max-steps 1500 --global-batch-size 32 --ema-warmup
Many GPUs/nodes:  accelerate launch --multi_gpu --num_processes 8 -m moh_dit.commands train --preset MoH-DiT-XL/2-90 \
                      --latents-dir imagenet_latents --output-dir runs/xl --global-batch-size 256
To resume, run the same command again with --resume latest (or --resume checkpoint-N: the checkpoint of step N).
From weights:     moh-dit train --init-from dit-xl-2-up75 --router-warmup-steps 2000 \
                      --latents-dir imagenet_latents --output-dir runs/up75   (the architecture is the folder's
                      config.json, so an upcycled layout needs no preset; a --preset given must match it; resume
                      with --resume latest, without --init-from: the checkpoints hold the weights and the model)
diffusers' spellings work too: --train_data_dir, --resolution, --train_batch_size, --max_train_steps,
                  --checkpointing_steps, --lr_warmup_steps, --resume_from_checkpoint, --dataloader_num_workers,
                  and every flag with underscores (--output_dir, --mixed_precision, --lr_scheduler).
Left out, --mixed-precision is accelerate's (accelerate launch's flag or config), --gradient-accumulation-steps
is ACCELERATE_GRADIENT_ACCUMULATION_STEPS when set, else 1 (accelerate launch's --gradient_accumulation_steps
is DeepSpeed's: give the trainer's flag), and --report-to is tensorboard if it is installed, else none; the run
prints what it uses.

The --output-dir belongs to one run: a second run into it while it trains is refused, and so
is a new run (no --resume) into a folder that holds one, or one inside --data-dir. With
--latents-dir the image size and VAE are the cache's. Checkpoints are safetensors and JSON,
checked against their recorded SHA-256 before a resume (see docs/training.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing

from moh_dit.errors import MoHDiTError
from moh_dit.models.presets import PRESETS
from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, EXPECTED_ERRORS, command, environment_fault, run_cli
from moh_dit.utils.logging import get_logger
from moh_dit.utils.speed import COMPILE_MODES
from moh_dit.training import TrainConfig, preflight, train
from moh_dit.training.config import (ACCUMULATION_ENV, DEFAULT_GLOBAL_BATCH_SIZE, DEFAULT_IMAGE_SIZE, DEFAULT_VAE,
                                     MIXED_PRECISIONS, ON_CORRUPT)
from moh_dit.training.schedules import LR_SCHEDULERS
from moh_dit.training.tracking import REPORT_TO

logger = get_logger(__name__)


def _zero_is_none(value: int | None) -> int | None:
    return value or None


# Each TrainConfig field's flag, in the order --help lists them: its help, and where needed its
# spelling (flag: when not --field-name; the destination is always the field's name, which is how
# the library's errors name it), choices, metavar, either-or group (one_of), negation (a boolean
# whose flag turns it off), a map of the parsed value onto the field's (from_flag), whether the
# command line must give it, and diffusers' example scripts' spellings (aliases, not in --help).
# Defaults and types are TrainConfig's. Every field but adam_betas and model_overrides has one.
FLAGS: dict[str, dict[str, typing.Any]] = {
    "preset": dict(choices=tuple(PRESETS), metavar="PRESET", help=f"model preset: {', '.join(PRESETS)}. Optional with "
                   "--init-from (the architecture is then the folder's config.json; a preset given must match it) and "
                   "with --resume (the run's recorded model)"),
    "data_dir": dict(help="ImageFolder: one sub-folder of images per class", one_of="data",
                     aliases=("--train_data_dir",)),
    "latents_dir": dict(help="latent cache written by moh-dit extract-latents", one_of="data"),
    "vae": dict(help=f"AutoencoderKL hub id or local folder, or 'none' for pixel space (default: {DEFAULT_VAE}; with "
                "--latents-dir, the cache's VAE)"),
    "vae_subfolder": dict(help="subfolder of --vae holding the VAE (e.g. 'vae' of a pipeline)"),
    "image_size": dict(help=f"image size in pixels (default: {DEFAULT_IMAGE_SIZE}; with --latents-dir, the size the "
                       "cache was made at)", aliases=("--resolution",)),
    "output_dir": dict(required=True),
    "max_steps": dict(help="optimiser steps of the whole run (default: %(default)s)", aliases=("--max_train_steps",)),
    "global_batch_size": dict(help=f"images per optimiser step over all processes (default: "
                              f"{DEFAULT_GLOBAL_BATCH_SIZE}, or --train-batch-size x processes x "
                              "--gradient-accumulation-steps)"),
    "train_batch_size": dict(help="images per process in one forward pass (diffusers' --train_batch_size); the global "
                             "batch is this x processes x --gradient-accumulation-steps"),
    "gradient_accumulation_steps": dict(help="forward/backward passes per optimiser step; the loss is scaled so that "
                                        f"the step equals one of the whole batch (default: {ACCUMULATION_ENV} when "
                                        "set, else 1; accelerate launch's --gradient_accumulation_steps is a "
                                        "DeepSpeed option that never reaches this trainer)"),
    "learning_rate": dict(),
    "lr_scheduler": dict(choices=LR_SCHEDULERS, help="diffusers.optimization's LR schedule over --max-steps "
                         "(default: %(default)s)"),
    "warmup_steps": dict(help="LR warm-up steps of --lr-scheduler (default: %(default)s)",
                         aliases=("--lr_warmup_steps",)),
    "weight_decay": dict(),
    "max_grad_norm": dict(help="clip gradients to this norm (default: off, as DiT)"),
    "checkpoint_every": dict(aliases=("--checkpointing_steps",)),
    "checkpoints_total_limit": dict(help="keep this many newest checkpoints of this run (0: all; default: "
                                    "%(default)s)", from_flag=_zero_is_none),
    "resume": dict(help="'latest' (the newest intact checkpoint of --output-dir; falls back past damaged ones), "
                   "checkpoint-N (its checkpoint of step N, as in diffusers' scripts) or a checkpoint folder",
                   aliases=("--resume_from_checkpoint",)),
    "init_from": dict(help="start a new run from the weights of a saved model folder (moh-dit upcycle's output; a "
                      "run's final/ or another pipeline folder: its transformer); new optimiser, EMA starting as a "
                      "copy of them; not with --resume"),
    "router_warmup_steps": dict(help="MoH presets: train only the router parameters for the first N steps "
                                "(default: %(default)s)"),
    "mixed_precision": dict(choices=MIXED_PRECISIONS, help="default: accelerate's choice (accelerate launch "
                            "--mixed_precision or its config, which set ACCELERATE_MIXED_PRECISION), else no"),
    "allow_tf32": dict(flag="--no-tf32", negated=True, help="disable TF32 matmuls on Ampere+ GPUs"),
    "seed": dict(),
    "lb_coeff": dict(help="weight of the MoH load-balance loss"),
    "ema_decay": dict(help="EMA decay; without --ema-warmup the EMA starts as an exact copy and decays at this rate "
                      "from the first step, as DiT (default: %(default)s)"),
    "ema_warmup": dict(help="diffusers' EMAModel warm-up: decay min(--ema-decay, 1 - (1 + t / --ema-inv-gamma) ** "
                       "-(--ema-power)) at step t, so short runs get a useful EMA"),
    "ema_inv_gamma": dict(help="with --ema-warmup (default: %(default)s)"),
    "ema_power": dict(help="with --ema-warmup: 2/3 suits runs of a million steps, 3/4 shorter ones (default: 2/3)"),
    "class_dropout": dict(help="label dropout for classifier-free guidance"),
    "gradient_checkpointing": dict(),
    "compile": dict(help="torch.compile the transformer (the first steps take longer while it compiles; checkpoints "
                    "are the same as without it, so a run may resume with or without the flag)"),
    "compile_per_block": dict(help="with --compile: compile each transformer block instead of the whole model "
                              "(compiles faster)"),
    "compile_mode": dict(choices=COMPILE_MODES, help="with --compile: torch.compile's mode (default: torch's "
                         "default)"),
    "num_workers": dict(aliases=("--dataloader_num_workers",)),
    "on_corrupt": dict(choices=ON_CORRUPT, help="unreadable images: stop with the file name (default) or skip and "
                       "count them"),
    "random_flip": dict(flag="--no-flip", negated=True, help="disable random horizontal flips"),
    "log_every": dict(),
    "sample_every": dict(help="save an EMA sample grid every N steps (0: off)"),
    "sample_steps": dict(help="DDPM steps of the monitoring grid"),
    "report_to": dict(choices=REPORT_TO, help="experiment tracker (default: tensorboard if it is installed, else "
                      "none); one that is asked for must be installed"),
}


def _flag_fields() -> dict[str, dataclasses.Field]:
    fields = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name not in ("adam_betas", "model_overrides")}
    if sorted(fields) != sorted(FLAGS):
        raise AssertionError(f"FLAGS lists {sorted(FLAGS)}, TrainConfig's options are {sorted(fields)}")
    return {name: fields[name] for name in FLAGS}


def _add_flag(parser, f: dataclasses.Field, value_type: type, root: ArgumentParser) -> None:
    """``f``'s flag on ``parser`` (``root`` or one of its groups): spelling, help, choices and
    aliases from FLAGS, default and type from the field; its destination is the field's name."""
    meta = FLAGS[f.name]
    name = meta.get("flag") or "--" + f.name.replace("_", "-")
    kwargs = {"dest": f.name, "help": meta.get("help")}
    if value_type is bool:
        kwargs.update(action="store_false" if meta.get("negated") else "store_true")
    elif meta.get("required"):
        kwargs.update(required=True)
    else:
        kwargs.update(default=f.default)
    if value_type in (int, float):
        kwargs["type"] = value_type
    if "choices" in meta:
        kwargs["choices"] = list(meta["choices"])
    if "metavar" in meta:
        kwargs["metavar"] = meta["metavar"]
    parser.add_argument(name, **kwargs)
    for alias in meta.get("aliases", ()):
        root.add_alias(alias, name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(TrainConfig)
    groups: dict[str, typing.Any] = {}
    for f in _flag_fields().values():
        one_of = FLAGS[f.name].get("one_of")
        if one_of is not None and one_of not in groups:
            groups[one_of] = p.add_mutually_exclusive_group(required=True)
        value_type = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        _add_flag(groups[one_of] if one_of is not None else p, f, value_type, p)
    p.add_argument("--dry-run", action="store_true",
                   help="check everything, print the resolved configuration and exit (writes nothing; refuses a "
                        "folder that another command is writing)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {}
    for name in _flag_fields():
        convert = FLAGS[name].get("from_flag")
        values[name] = getattr(args, name) if convert is None else convert(getattr(args, name))
    return TrainConfig(**values)


class MachineFaultError(OSError):
    """A fault of the machine met by the run (a full disk, a quota, a read-only file system):
    shown as its message, which names the path, rather than in Python's ``[Errno N] ...`` form."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


@command
def main(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except OSError as error:
        fault = None if isinstance(error, MachineFaultError) else environment_fault(error)
        if fault is None:
            raise
        # A fault the trainer explained names the option to resume with (its parameters): as its flag here.
        fault = MoHDiTError(fault, parameters=getattr(error, "parameters", ())).for_command(ArgumentParser.last_flags)
        raise MachineFaultError(error.errno, fault) from error


def _run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.dry_run:
        what = preflight(cfg)
        # As the run would record it: a latent cache's image size and VAE filled in.
        print(json.dumps(cfg.resolved().__dict__, indent=2, default=str))
        print(what, file=sys.stderr)
        return 0
    final = train(cfg)
    if os.environ.get("RANK", "0") == "0":  # once, not by every process of a distributed launch
        logger.info(f"Done. EMA model: {final}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv, errors=(*EXPECTED_ERRORS, OSError))


if __name__ == "__main__":
    sys.exit(cli())
