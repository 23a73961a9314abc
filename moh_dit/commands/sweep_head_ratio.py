"""The head-activation sweep: FID, sFID, IS, precision, recall and attention FLOPs of one model
at several head activation ratios, with the same images (seeds, labels) at every ratio.

    moh-dit sweep --model moh-dit-xl-2-90-pipeline \\
        --ref VIRTUAL_imagenet256_labeled.npz --inception-weights weights-inception-2015-12-05-6726825d.pth \\
        --ratios trained,1.0,0.9,0.75,0.6,min --num-samples 10000 --batch-size 64 \\
        --num-inference-steps 250 --guidance-scale 1.5 --output-dir sweeps/xl-90

Head-activation schedules (a ratio per denoising step) go into --ratios beside the constant
ratios; --match-flops adds, for each schedule, the constant ratio of closest mean attention
FLOPs, so that the two are compared at (nearly) equal cost:

    moh-dit sweep ... --ratios '1.0,trained,min,linear:0.5:1.0,step:0.5@t>500,1.0' --match-flops

Writes OUTPUT_DIR/sweep.json (rows + settings), OUTPUT_DIR/sweep.csv and
OUTPUT_DIR/fid_vs_ratio.png (FID and class accuracy against mean attention FLOPs, with 95%
intervals: a bootstrap for FID, Wilson for class accuracy), and prints a table (not with --quiet).
``--model``: a pipeline folder, a training run's folder (its final/, with the run's VAE) or a
save_pretrained transformer folder (pixel space, or give --vae). ``--ref``: ADM's reference batch or a folder / .npz of real
images (e.g. the training ImageFolder for the demo). Without the published Inception weights
the command stops with advice; ``--random-inception-seed N`` explicitly uses a random
Inception instead, and everything is then labelled not comparable to published numbers.
All the work is done by :func:`moh_dit.sampling.sweep.sweep_head_activation`.
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from pathlib import Path

import torch

from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, command, run_cli
from moh_dit.utils.logging import get_logger, info_enabled
from moh_dit.evaluation import INCEPTION_WEIGHTS_ENV, reference_cache_dir
from moh_dit.utils.output_folders import check_outside_inputs, hold_output_folder
from moh_dit.sampling.sample_files import check_own_folder
from moh_dit.diffusion.schedulers import SCHEDULERS
from moh_dit.models.head_schedule import SCHEDULE_EXAMPLES
from moh_dit.pipelines.pipeline_moh_dit import GUIDANCE_CHANNELS, SEED_RANGE
from moh_dit.sampling.sample import DTYPES, SampleSettings, load_pipeline
from moh_dit.sampling.sweep import (
    ATTENTION_PATHS,
    BOOTSTRAP_RESAMPLES,
    DEFAULT_RATIOS,
    is_sweep_folder,
    SweepSettings,
    check_sample_count,
    plan_sweep,
    sweep_head_activation,
    transformer_calls_per_image,
    write_sweep,
)

logger = get_logger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a MoHDiTPipeline folder, a training run folder (its final/) or "
                        "a save_pretrained transformer folder")
    parser.add_argument("--ref", required=True, help="ADM reference batch .npz, or an image folder / .npz of real images")
    parser.add_argument("--ratios", default=",".join(str(r) for r in DEFAULT_RATIOS),
                        help="comma-separated head activation ratios in (0, 1], 'trained', 'min' and schedules "
                             f"({SCHEDULE_EXAMPLES}; quote the list in a shell; default: %(default)s)")
    parser.add_argument("--head-usage-images", type=int, default=2,
                        help="images per class for the head-usage figure at the trained ratio, written to "
                             "OUTPUT_DIR/head_usage/ (moh-dit plot-head-usage's figure; 0: none; dense models get none)")
    parser.add_argument("--match-flops", action="store_true",
                        help="for each schedule, also sweep the constant ratio whose attention FLOPs are closest to "
                             "the schedule's mean (realisable top-K; the remaining FLOP difference is reported)")
    parser.add_argument("--bootstrap", type=int, default=BOOTSTRAP_RESAMPLES,
                        help="resamples of the FID bootstrap interval (0: none; default: %(default)s)")
    parser.add_argument("--output-dir", default="head_ratio_sweep",
                        help="folder for sweep.json/csv and fid_vs_ratio.png (default: %(default)s)")
    parser.add_alias("--output", "--output-dir")
    parser.add_argument("--num-samples", type=int, default=50_000, help="images per ratio")
    parser.add_argument("--batch-size", type=int, default=32, help="images per sampling batch")
    parser.add_argument("--eval-batch-size", type=int, default=64, help="images per Inception forward pass")
    parser.add_argument("--num-inference-steps", type=int, default=250)
    parser.add_argument("--guidance-scale", type=float, default=1.5, help="classifier-free guidance; 1 = none")
    parser.add_argument("--guidance-channels", choices=GUIDANCE_CHANNELS, default="dit",
                        help="'dit': guide the first 3 eps channels like DiT's sampler (default); 'all': every channel")
    parser.add_argument("--seed", type=int, default=0, help="image i uses seed + i (class i mod num_classes) at every ratio")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--inception-weights", default=None,
                         help=f"InceptionV3 weights file (default: ${INCEPTION_WEIGHTS_ENV}, the torch hub cache, a download)")
    weights.add_argument("--random-inception-seed", type=int, default=None,
                         help="use a random Inception with this seed (offline demos only: NOT comparable to published numbers)")
    parser.add_argument("--no-download", action="store_true", help="never try to download the Inception weights")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--vae", default=None,
                        help="AutoencoderKL path or Hub id, or 'none' (default: the pipeline folder's own -- a run's, "
                             "for a run folder; none for a transformer folder)")
    parser.add_argument("--scheduler", choices=SCHEDULERS + ("saved",), default="ddpm",
                        help="ddpm: the paper's learned-variance DDPM (default); ddim; dpm; saved: a pipeline folder's own")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="transformer dtype (the VAE stays float32)")
    parser.add_argument("--attention", choices=list(ATTENTION_PATHS), default="auto",
                        help="attention path for sampling (affects wall time only): auto (the model's setting; by "
                             "default head-sparse only for large, sparse layers on the CPU), "
                             "masked (every head computed, as the release) or sparse")
    parser.add_argument("--save-samples", action="store_true", help="also write each ratio's PNGs under OUTPUT_DIR/ratio_X/samples/")
    parser.add_argument("--cache-dir", default=None, help="reference statistics cache (default: see docs/evaluation.md; $MOH_DIT_CACHE moves it)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the reference statistics cache")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved ratios, top-K and FLOPs as JSON on stdout (also with --quiet), and exit")
    parser.add_argument("--classifier", default=None,
                        help="add class accuracy per ratio: a moh-dit train-classifier folder or torchvision:NAME")
    parser.add_argument("--classifier-weights", default=None,
                        help="local state-dict file for a torchvision:NAME classifier (offline)")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """The flags that are the command's own, before anything is loaded or written. The library
    checks the others where it uses them (SampleSettings, SweepSettings, load_pipeline, and the
    sweep's planning with the pipeline's check_inputs), before the first image, naming parameters
    that run_cli shows as these flags."""
    if args.head_usage_images < 0:
        raise ValueError(f"--head-usage-images must be >= 0 (0: no head-usage figure), got {args.head_usage_images}.")
    if args.random_inception_seed is not None and not 0 <= args.random_inception_seed <= SEED_RANGE[1]:
        raise ValueError(f"--random-inception-seed must be in [0, {SEED_RANGE[1]}], got {args.random_inception_seed}.")
    ref = Path(args.ref).expanduser()
    if not ref.exists():
        raise FileNotFoundError(f"--ref {args.ref} does not exist; give an ADM reference batch .npz, an image .npz "
                                "or an image folder.")
    if ref.is_file() and not zipfile.is_zipfile(ref):
        raise ValueError(f"--ref {args.ref} is not an .npz file (nor a folder); give an ADM reference batch .npz, an "
                         "image .npz or an image folder.")
    if args.inception_weights is not None and not Path(args.inception_weights).expanduser().is_file():
        what = "is a folder" if Path(args.inception_weights).expanduser().is_dir() else "does not exist"
        raise FileNotFoundError(f"--inception-weights {args.inception_weights} {what}; give the weights file "
                                "(weights-inception-2015-12-05-6726825d.pth).")
    if args.classifier_weights is not None and args.classifier is None:
        raise ValueError("--classifier-weights needs --classifier torchvision:NAME")
    if args.classifier is not None and not args.classifier.startswith("torchvision:"):
        if not (Path(args.classifier).expanduser() / "classifier.json").is_file():
            raise FileNotFoundError(f"--classifier {args.classifier} is not a classifier folder (no classifier.json); "
                                    "make one with moh-dit train-classifier or give torchvision:NAME")
    check_outputs(args)


def sweep_inputs(args: argparse.Namespace) -> dict[str, Path | None]:
    """Every file or folder the sweep reads, by flag (None: not given, or not a local path)."""
    def local(value: str | None) -> Path | None:
        return None if value is None or not Path(value).expanduser().exists() else Path(value).expanduser()

    classifier = None if args.classifier is None or args.classifier.startswith("torchvision:") else args.classifier
    return {"--model": local(args.model), "--ref": local(args.ref), "--vae": local(args.vae),
            "--classifier": local(classifier), "--classifier-weights": local(args.classifier_weights),
            "--inception-weights": local(args.inception_weights)}


def check_outputs(args: argparse.Namespace) -> None:
    """The output folder and the reference cache are never what the sweep reads, and the output
    folder is new, empty, or an earlier sweep's (marked, or holding sweep.json)."""
    inputs = sweep_inputs(args)
    check_outside_inputs(Path(args.output_dir).expanduser(), inputs, "--output-dir")
    if not args.no_cache:
        cache = Path(args.cache_dir).expanduser() if args.cache_dir is not None else reference_cache_dir()
        check_outside_inputs(cache, inputs, "--cache-dir")
    check_own_folder(args.output_dir, "sweep", is_sweep_folder)


def sample_settings(args: argparse.Namespace) -> SampleSettings:
    """What decides the images: the same at every ratio (class i mod num_classes, seed --seed + i)."""
    return SampleSettings(
        num_samples=args.num_samples, guidance_scale=args.guidance_scale, guidance_channels=args.guidance_channels,
        num_inference_steps=args.num_inference_steps, seed=args.seed,
    )


def sweep_settings(args: argparse.Namespace) -> SweepSettings:
    """How the sweep runs (checked when made: batch sizes, device, folders, bootstrap)."""
    return SweepSettings(
        batch_size=args.batch_size, eval_batch_size=args.eval_batch_size, device=args.device, attention=args.attention,
        output_dir=args.output_dir, save_samples=args.save_samples, cache_dir=args.cache_dir, use_cache=not args.no_cache,
        inception_weights=args.inception_weights, random_inception_seed=args.random_inception_seed,
        download=not args.no_download, vae=args.vae, scheduler=args.scheduler, dtype=args.dtype,
        classifier=args.classifier, classifier_weights=args.classifier_weights, progress=info_enabled(),
        bootstrap=args.bootstrap, match_flops=args.match_flops,
    )


def dry_run(args: argparse.Namespace, pipe, images: SampleSettings) -> dict:
    check_sample_count(images.num_samples)  # what the sweep itself refuses first
    planned = plan_sweep(pipe, args.ratios, images, match_flops=args.match_flops)
    calls = transformer_calls_per_image(args.num_inference_steps, args.guidance_scale)
    plans = []
    for plan in planned:
        sparse, dense, steps = plan.attention_flops(pipe.transformer)
        entry = dict(ratio=plan.label, realised_ratio=plan.realised_ratio, top_k_per_layer=plan.top_k_per_layer,
                     attention_flops_per_image=sparse * calls // steps, attention_flop_ratio=sparse / dense)
        if plan.schedule is not None:
            entry.update(schedule=plan.schedule.spec, head_activation_ratios=plan.schedule.realised,
                         top_k_per_step=plan.schedule.top_k,
                         matched_constant=None if plan.matched is None else plan.matched.label)
        plans.append(entry)
    report = {"args": vars(args), "transformer_calls_per_image": calls, "plans": plans}
    # The report is what --dry-run asks for (data for the terminal or a pipe), not a progress
    # message: it is printed whatever the log level.
    print(json.dumps(report, indent=2))
    return report


@command
def main(args: argparse.Namespace):
    check_args(args)
    images, settings = sample_settings(args), sweep_settings(args)
    # Loaded once, for the sweep and the head-usage figure.
    pipe = load_pipeline(args.model, vae=args.vae, scheduler=args.scheduler, dtype=args.dtype)
    if args.dry_run:
        return dry_run(args, pipe, images)
    # One writer per output folder, from the first image to the last file written.
    with hold_output_folder(Path(args.output_dir).expanduser(), "sweep"):
        check_own_folder(args.output_dir, "sweep", is_sweep_folder)  # again, now that no other sweep can write it
        result = sweep_head_activation(pipe, args.ratios, args.ref, images, settings, log=logger.info,
                                       model_label=str(Path(args.model).resolve()))
        result.settings["args"] = vars(args)
        paths = write_sweep(result, args.output_dir)
        paths.update(_head_usage_figure(args, pipe))
    logger.info(result.table())
    logger.info("wrote " + ", ".join(str(p) for p in paths.values()))
    return result


def _head_usage_figure(args: argparse.Namespace, pipe) -> dict[str, Path]:
    """The head-usage figure of the swept model (``pipe``, on ``--device``, as the sweep leaves it:
    its trained ratio and attention path) from a few images per class, the sweep's steps and seed,
    no guidance, written to OUTPUT_DIR/head_usage/; nothing for a dense model or with
    --head-usage-images 0."""
    from moh_dit.evaluation.head_usage import measure_head_usage, write_head_usage
    from moh_dit.sampling.sweep_results import model_name

    if args.head_usage_images == 0:
        return {}
    if not pipe.transformer.is_moh:
        return {}
    usage = measure_head_usage(pipe, images_per_class=args.head_usage_images,
                               num_inference_steps=args.num_inference_steps, seed=args.seed, progress=info_enabled())
    name = model_name(Path(args.model).expanduser().resolve())
    paths = write_head_usage(usage, Path(args.output_dir).expanduser() / "head_usage", f"{name}: head usage")
    return {"head_usage_" + kind: path for kind, path in paths.items()}


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    sys.exit(cli())
