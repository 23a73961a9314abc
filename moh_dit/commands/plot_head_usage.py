"""Draw the head-usage figures: which heads each layer of a MoH-DiT uses, overall, per class and
per timestep range (from samples), or over training (from a run's log).

    moh-dit plot-head-usage --model MODEL --output-dir figures/heads
    moh-dit plot-head-usage --log RUN/head_usage.jsonl --output-dir figures/heads-training

With ``--model`` (a pipeline folder, a ``save_pretrained`` transformer folder, or a training run
with ``final/``) it samples ``--images-per-class`` images of each of ``--classes`` (default:
every class of a model with up to 16, else 8 spread over the ids) and records every layer's
head usage at every step. With ``--log`` it reads what training logged (``head_usage.jsonl``,
or the run folder). Writes ``head_usage.png`` and ``head_usage.json`` (the plotted numbers)
to ``--output-dir``; docs/head_usage.md explains the figure.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from moh_dit.evaluation.head_usage import MAX_DEFAULT_CLASSES, default_classes
from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, command, run_cli
from moh_dit.utils.logging import get_logger

logger = get_logger(__name__)

# --model's flags and their defaults (None on the parser, so that --log can refuse them).
_SAMPLING_DEFAULTS = {"classes": None, "images_per_class": 4, "num_inference_steps": 50, "guidance_scale": 1.0,
                      "head_activation_ratio": None, "seed": 0, "timestep_bins": 4, "vae": None, "device": None,
                      "dtype": "float32"}
_SEED_MAX = 0xFFFF_FFFF_FFFF_FFFF  # torch.Generator.manual_seed's largest seed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a pipeline folder, a save_pretrained transformer folder, or a training run "
                        "folder with final/: sample it and measure")
    source.add_argument("--log", help="a run's head_usage.jsonl (or the run folder): the usage over training")
    p.add_argument("--output-dir", required=True, help="folder to write head_usage.png and head_usage.json to")
    p.add_alias("--output", "--output-dir")
    p.add_argument("--classes", nargs="+", help="class ids or names to sample (default: every class of a model with "
                   f"up to {MAX_DEFAULT_CLASSES}, else 8 spread over the ids)")
    p.add_argument("--images-per-class", type=int, help="images sampled per class (default 4)")
    p.add_argument("--num-inference-steps", type=int, help="sampling steps (default 50)")
    p.add_argument("--guidance-scale", type=float, help="classifier-free guidance (default 1: none); above 1 the "
                   "unconditional half of every batch counts in the usage too")
    p.add_argument("--head-activation-ratio", type=float, help="run at this head activation (default: as trained)")
    p.add_argument("--seed", type=int, help="image i of every class uses seed + i (default 0)")
    p.add_argument("--timestep-bins", type=int, help="timestep ranges in the per-timestep view (default 4)")
    p.add_argument("--vae", help="AutoencoderKL for a latent transformer folder (default: a pipeline folder's own, a "
                   "run's for a run folder; never run: latents are not decoded)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="transformer dtype (default float32)")
    p.add_argument("--step-bins", type=int, default=4, help="with --log: ranges of training steps shown (default 4)")
    p.add_argument("--title", help="the figure's title (default: the model's or run's folder name)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier plot-head-usage folder (never a folder this command did not write)")
    return p.parse_args(argv)


def _check_flags(args: argparse.Namespace) -> None:
    """Every flag that can be checked without the model; fills in the sampling defaults."""
    if args.log is not None:
        given = [name for name in _SAMPLING_DEFAULTS if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} applies to --model only; --log plots what training "
                             "logged (use --step-bins for its ranges).")
    for name, default in _SAMPLING_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for flag in ("images_per_class", "num_inference_steps", "timestep_bins", "step_bins"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}.")
    if not (math.isfinite(args.guidance_scale) and args.guidance_scale >= 1):
        raise ValueError(f"--guidance-scale must be a finite number >= 1 (1 = no guidance), got {args.guidance_scale}.")
    if not 0 <= args.seed <= _SEED_MAX - args.images_per_class + 1:
        raise ValueError(f"--seed must be in [0, {_SEED_MAX - args.images_per_class + 1}] (image i uses seed + i), "
                         f"got {args.seed}.")


def _check_paths(args: argparse.Namespace) -> tuple[Path | None, Path]:
    """The inputs exist and the output may be written; returns (model folder or None, output)."""
    from moh_dit.utils.output_folders import check_output_folder, check_outside_inputs

    model = None
    if args.model is not None:
        from moh_dit.sampling.sample import check_model_flags, model_folder

        check_model_flags(args.model, args.vae)
        model = model_folder(args.model)  # a training run's final/
    elif not Path(args.log).expanduser().exists():
        raise FileNotFoundError(f"--log {args.log} does not exist; give a run's head_usage.jsonl or its run folder.")
    out = Path(args.output_dir).expanduser()
    check_output_folder(out, args.overwrite, what="a folder moh-dit plot-head-usage wrote", parameter="output_dir")
    log = None if args.log is None else Path(args.log).expanduser()
    # The log's folder is a training run's: the figures never go into it (nor the model's folder).
    check_outside_inputs(out, {"model": None if args.model is None else Path(args.model).expanduser(),
                               "log": log if log is None or log.is_dir() else log.parent}, "output_dir")
    return model, out


def _class_arguments(values: list[str] | None, num_classes: int) -> list[int | str]:
    if values is None:
        return default_classes(num_classes)
    return [int(v) if v.strip().isdigit() else v for v in values]


def _load(args: argparse.Namespace, model: Path):
    """The pipeline on its device, the classes to sample as ids; refuses a dense model and
    checks the classes and the ratio, all before anything is written."""
    import torch

    from moh_dit.models.head_activation import preview_head_activation
    from moh_dit.sampling.sample import load_pipeline

    pipe = load_pipeline(model, vae=args.vae, dtype=args.dtype)
    transformer = pipe.transformer
    if not transformer.is_moh:
        raise ValueError(f"--model {args.model} is a dense DiT: every token uses every head, so there is no head "
                         "usage to plot.")
    steps = pipe.scheduler.config.num_train_timesteps
    if args.num_inference_steps > steps:
        raise ValueError(f"--num-inference-steps {args.num_inference_steps} exceeds the {steps} diffusion steps the "
                         f"model was trained with; use 1..{steps}.")
    try:
        ids = pipe.get_label_ids(_class_arguments(args.classes, transformer.config.num_classes))
    except ValueError as error:
        raise ValueError(f"--classes: {error}") from None
    if len(set(ids)) != len(ids):
        raise ValueError(f"--classes names a class twice ({' '.join(args.classes)}); give each class once.")
    try:
        preview_head_activation(transformer, args.head_activation_ratio)
    except ValueError as error:  # the model's message names its reachable range
        raise ValueError(f"--head-activation-ratio: {error}") from None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        pipe.to(torch.device(device))
    except (RuntimeError, AssertionError) as error:
        raise ValueError(f"--device {device}: {error}") from None
    return pipe, ids


@command
def main(args: argparse.Namespace) -> int:
    from moh_dit.evaluation.head_usage import head_usage_from_log, measure_head_usage, write_head_usage
    from moh_dit.utils.io import publish_folder
    from moh_dit.utils.output_folders import check_output_folder, hold_output_folder, write_output_marker

    _check_flags(args)
    model, out = _check_paths(args)
    if model is not None:
        pipe, ids = _load(args, model)
        title = args.title or Path(args.model).expanduser().resolve().name
    else:
        usage = head_usage_from_log(Path(args.log).expanduser(), bins=args.step_bins)  # read and checked here
        log = Path(args.log).expanduser().resolve()
        title = args.title or f"{(log if log.is_dir() else log.parent).name}: head usage over training"
    with hold_output_folder(out, "plot-head-usage", "output_dir"):
        check_output_folder(out, args.overwrite, what="a folder moh-dit plot-head-usage wrote", parameter="output_dir")
        if model is not None:
            usage = measure_head_usage(pipe, ids, images_per_class=args.images_per_class,
                                       num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale,
                                       head_activation_ratio=args.head_activation_ratio, seed=args.seed,
                                       timestep_bins=args.timestep_bins)
        with publish_folder(out, replace=out.exists()) as tmp:
            write_head_usage(usage, tmp, title)
            write_output_marker(tmp, "plot-head-usage")
    logger.info(f"wrote {out / 'head_usage.png'} and head_usage.json ({usage.num_layers} layers, "
                f"{len(usage.per_class)} classes, {len(usage.per_timestep)} ranges)")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    sys.exit(cli())
