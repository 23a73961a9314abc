"""moh-dit plot-head-usage: which heads each layer of a MoH-DiT uses, overall, per class and per
timestep range (sampled from --model), or over training (from a run's head_usage.jsonl).

    moh-dit plot-head-usage --model runs/tiny/final --output-dir figures/heads
    moh-dit plot-head-usage --log runs/tiny/head_usage.jsonl --output-dir figures/heads-training

Writes head_usage.png and head_usage.json (the plotted numbers). Latents are never decoded.
"""

from __future__ import annotations

import argparse
import logging

from . import int_range
from .sample import DTYPES

DESCRIPTION = "figures of which heads each layer uses (from samples or a training log)"


def build_parser(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a pipeline folder, a transformer folder or a training run: sample it")
    source.add_argument("--log", help="a run's head_usage.jsonl (or the run folder): the usage over training")
    parser.add_argument("--output-dir", "--output_dir", "--output", dest="output_dir", required=True)
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier plot-head-usage folder")
    parser.add_argument("--classes", nargs="+", help="class ids or names (default: every class of a model with up "
                        "to 16, else 8 spread over the ids)")
    parser.add_argument("--images-per-class", type=int_range(1, 10_000), default=4)
    parser.add_argument("--num-inference-steps", type=int_range(1, 10_000), default=50)
    parser.add_argument("--guidance-scale", type=float, default=1.0,
                        help="above 1 the unconditional half of every batch counts too")
    parser.add_argument("--head-activation-ratio", type=float, help="run at this ratio (default: the trained one)")
    parser.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0, help="image i of every class uses seed + i")
    parser.add_argument("--timestep-bins", type=int_range(1, 1000), default=4, help="timestep ranges shown")
    parser.add_argument("--vae", help="AutoencoderKL of a latent transformer folder (loaded, never run)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="transformer dtype")
    parser.add_argument("--step-bins", type=int_range(1, 1000), default=4, help="with --log: training-step ranges")
    parser.add_argument("--title", help="the figure's title (default: the model's or run's folder name)")


def main(args: argparse.Namespace) -> None:
    from pathlib import Path

    from moh_dit.head_usage import JSON_FILE, PLOT_FILE, head_usage_from_log, measure_head_usage, write_head_usage
    from moh_dit.outputs import output_folder

    source = Path(args.model or args.log).expanduser().resolve()
    # An input file protects that file (and so its folder as a whole output), not what lies below.
    inputs = {"model": args.model} if args.model else {"log": args.log}
    with output_folder(args.output_dir, "plot-head-usage", overwrite=args.overwrite, publish=True,
                       inputs=inputs) as folder:
        if args.log:
            usage = head_usage_from_log(source, bins=args.step_bins)
            title = f"{(source if source.is_dir() else source.parent).name}: head usage over training"
        else:
            import torch

            from moh_dit.sampling import load_pipeline

            pipe = load_pipeline(source, vae=args.vae, dtype=getattr(torch, args.dtype))
            pipe.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            classes = None if args.classes is None else [int(c) if c.isdigit() else c for c in args.classes]
            usage = measure_head_usage(pipe, classes, images_per_class=args.images_per_class,
                                       num_inference_steps=args.num_inference_steps,
                                       guidance_scale=args.guidance_scale,
                                       head_activation_ratio=args.head_activation_ratio, seed=args.seed,
                                       timestep_bins=args.timestep_bins, progress=args.log_level <= logging.INFO)
            title = f"{source.name}: head usage"
        write_head_usage(usage, folder, args.title or title)
    logging.getLogger(__name__).info("wrote %s and %s", Path(args.output_dir) / PLOT_FILE, JSON_FILE)
