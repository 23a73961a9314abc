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

from moh_dit.utils.cli import ArgumentParser, EXPECTED_ERRORS, command, environment_fault, run_cli
from moh_dit.utils.logging import get_logger
from moh_dit.training import TrainConfig, TrainingDivergedError, preflight, train

logger = get_logger(__name__)

# The order --help lists the flags in (each TrainConfig field with a flag, once; checked).
HELP_ORDER = ("preset", "data_dir", "latents_dir", "vae", "vae_subfolder", "image_size", "output_dir", "max_steps",
              "global_batch_size", "train_batch_size", "gradient_accumulation_steps", "learning_rate", "lr_scheduler",
              "warmup_steps", "weight_decay", "max_grad_norm",
              "checkpoint_every", "checkpoints_total_limit", "resume", "init_from", "router_warmup_steps",
              "mixed_precision", "allow_tf32", "seed", "lb_coeff", "ema_decay", "ema_warmup", "ema_inv_gamma",
              "ema_power", "class_dropout",
              "gradient_checkpointing", "compile", "compile_per_block", "compile_mode", "num_workers", "on_corrupt",
              "random_flip", "log_every", "sample_every", "sample_steps", "report_to")


def _flag_fields() -> dict[str, dataclasses.Field]:
    fields = {f.name: f for f in dataclasses.fields(TrainConfig) if "flag" in f.metadata}
    if sorted(fields) != sorted(HELP_ORDER):
        raise AssertionError(f"HELP_ORDER lists {sorted(HELP_ORDER)}, TrainConfig's flags are {sorted(fields)}")
    return {name: fields[name] for name in HELP_ORDER}


def _add_flag(parser, f: dataclasses.Field, value_type: type, root: ArgumentParser) -> None:
    """``f``'s flag on ``parser`` (``root`` or one of its groups): spelling, help, choices and
    aliases from its metadata, default and type from the field."""
    meta = f.metadata
    name = meta["flag"] or "--" + f.name.replace("_", "-")
    kwargs = {"dest": f.name, "help": meta["help"]}
    if value_type is bool:
        kwargs.update(action="store_false" if meta["negated"] else "store_true")
    elif meta["required"]:
        kwargs.update(required=True)
    else:
        kwargs.update(default=f.default)
    if value_type in (int, float):
        kwargs["type"] = value_type
    for key in ("choices", "metavar"):
        if meta[key] is not None:
            kwargs[key] = list(meta[key]) if key == "choices" else meta[key]
    parser.add_argument(name, **kwargs)
    for alias in meta["aliases"]:
        root.add_alias(alias, name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(TrainConfig)
    groups: dict[str, typing.Any] = {}
    for f in _flag_fields().values():
        one_of = f.metadata["one_of"]
        if one_of is not None and one_of not in groups:
            groups[one_of] = p.add_mutually_exclusive_group(required=True)
        value_type = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        _add_flag(groups[one_of] if one_of is not None else p, f, value_type, p)
    p.add_argument("--dry-run", action="store_true",
                   help="check everything, print the resolved configuration and exit (writes nothing, takes no lock; "
                        "refuses a folder that a live run holds)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {}
    for name, f in _flag_fields().items():
        convert = f.metadata["from_flag"]
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
    return run_cli(main, parse_args, argv, errors=(*EXPECTED_ERRORS, OSError, TrainingDivergedError))


if __name__ == "__main__":
    sys.exit(cli())
