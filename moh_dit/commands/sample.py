"""Sample a MoH-DiT for FID: per-index seeds, balanced labels, PNGs + one ADM ``.npz``.

    accelerate launch scripts/sample.py --model moh-dit-xl-2-90 --vae stabilityai/sd-vae-ft-ema \\
        --num-samples 50000 --per-device-batch-size 32 --guidance-scale 1.5 \\
        --num-inference-steps 250 --head-activation-ratio 0.9 --output-dir samples/xl-90-cfg1.5

--model is a pipeline folder, a training run's folder (its final/ pipeline, with the run's VAE:
no --vae needed) or a save_pretrained transformer folder.

Image i (class i mod num_classes, seed --seed + i) is the same for any number of devices
and any batch size. To resume after a crash, run the same command again: finished PNGs
are skipped, and a damaged one (cut short, or one the .npz writer cannot decode) is made
again with a warning naming it. The run settings are written to OUTPUT/sample_config.json
once every setting has been checked against the model (nothing is written for a refused
command); a resumed run must match them, unless the folder holds no sample yet. One command
writes a folder at a time (a second one stops, naming the first); a folder holding files
this command did not write, or one that is or holds --model / --vae, is refused. Works with
plain ``python`` on one device (CPU included).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
import time
from pathlib import Path

from accelerate import Accelerator

from moh_dit.commands import command_prog
from moh_dit.utils.cli import ArgumentParser, command, run_cli
from moh_dit.utils.output_folders import check_outside_inputs, hold_output_folder
from moh_dit.utils.logging import get_logger, info_enabled
from moh_dit.diffusion.schedulers import SCHEDULERS
from moh_dit.models.head_schedule import SCHEDULE_EXAMPLES, schedule_setting
from moh_dit.pipelines.pipeline_moh_dit import GUIDANCE_CHANNELS
from moh_dit.utils.speed import COMPILE_MODES, compile_model
from moh_dit.sampling.sample import (
    CLASS_LABEL_MODES,
    DTYPES,
    ClassLabels,
    SampleSettings,
    check_folder_path,
    check_sample_folder,
    check_npz_fits_on_disk,
    check_or_write_settings,
    check_settings,
    load_pipeline,
    model_folder,
    preview_head_activation,
    remake_image,
    run_identity,
    sample_images,
    write_adm_npz,
)

logger = get_logger(__name__)


def ratio_or_schedule(text: str) -> float | str:
    """``--head-activation-ratio``'s value: a float for a number (checked against the model by the
    pipeline), else a head-activation schedule's canonical spec; argparse reports a bad schedule in one line."""
    try:
        return schedule_setting(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog=command_prog(__spec__.name), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a MoHDiTPipeline folder, a training run folder (its final/) or a save_pretrained "
                             "transformer folder")
    parser.add_argument("--vae", default=None,
                        help="AutoencoderKL path or Hub id, or 'none' for pixel-space models "
                             "(default: the pipeline folder's own VAE -- a run's, for a run folder; none for a "
                             "transformer folder)")
    parser.add_argument("--output-dir", required=True,
                        help="output folder: samples/*.png, samples.npz, sample_config.json")
    parser.add_alias("--output", "--output-dir")  # the earlier name
    parser.add_argument("--num-samples", type=int, default=50_000)
    parser.add_argument("--per-device-batch-size", type=int, default=32)
    parser.add_argument("--guidance-scale", type=float, default=1.5, help="classifier-free guidance; 1 = none")
    parser.add_argument("--guidance-channels", choices=GUIDANCE_CHANNELS, default="dit",
                        help="'dit': guide the first 3 eps channels like DiT's sampler, which the paper's numbers "
                             "used (default); 'all': every eps channel, like diffusers' DiTPipeline")
    parser.add_argument("--num-inference-steps", type=int, default=250)
    parser.add_argument("--scheduler", choices=SCHEDULERS + ("saved",), default=None,
                        help="default: a pipeline folder's own scheduler (the images MoHDiTPipeline.from_pretrained "
                             "gives), the paper's learned-variance DDPM for a transformer folder; ddpm, ddim or dpm "
                             "(DPM-Solver++) replace it (said in the output and in sample_config.json)")
    parser.add_argument("--clip-sample", choices=["auto", "yes", "no"], default="auto",
                        help="with a scheduler built here: clamp predicted x0 to [-1, 1]; auto: yes for pixel-space "
                             "models, no for latent ones")
    parser.add_argument("--head-activation-ratio", type=ratio_or_schedule, default=None,
                        help="head-weighted activation ratio for sampling (default: the trained one), or a schedule "
                             f"that sets it per denoising step ({SCHEDULE_EXAMPLES}; quote it in a shell; see "
                             "docs/sampling.md)")
    parser.add_argument("--seed", type=int, default=0, help="image i uses seed + i")
    parser.add_argument("--class-labels", choices=CLASS_LABEL_MODES, default="balanced",
                        help="balanced: class i mod num_classes (50 per class for 50k); uniform: random per index")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="transformer dtype (the VAE stays float32)")
    parser.add_argument("--no-npz", action="store_true", help="write only the PNGs")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the transformer before sampling (same images to float rounding; the "
                             "first batch takes longer while it compiles)")
    parser.add_argument("--compile-mode", choices=list(COMPILE_MODES), default=None,
                        help="with --compile: torch.compile's mode, e.g. reduce-overhead (CUDA graphs on a GPU)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved settings and exit")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """The flags that are the command's own, before anything is loaded or written. The library
    checks the others where it uses them (SampleSettings, load_pipeline, the pipeline's
    check_inputs), before anything is written, naming parameters that run_cli shows as these flags."""
    if args.per_device_batch_size < 1:
        raise ValueError(f"--per-device-batch-size must be >= 1, got {args.per_device_batch_size}.")
    if args.scheduler == "dpm" and args.clip_sample == "yes":
        raise ValueError("--clip-sample yes does not apply to --scheduler dpm (DPM-Solver has no x0 clipping); "
                         "use --clip-sample auto or no.")
    if args.compile_mode is not None and not args.compile:
        raise ValueError("--compile-mode sets how --compile compiles; add --compile or drop it.")
    check_folder_path(args.output_dir, "--output-dir", "give a folder (it is created if missing)")
    local_vae = args.vae if args.vae is not None and Path(args.vae).expanduser().is_dir() else None
    check_outside_inputs(args.output_dir, {"--model": Path(args.model).expanduser(),
                                           "--vae": None if local_vae is None else Path(local_vae).expanduser()})
    check_sample_folder(args.output_dir)


def head_activation_record(pipe, settings: SampleSettings, plan) -> dict:
    """What the run's head activation realises, for ``sample_config.json``: the ratio and per-layer
    top-K; for a schedule (``plan``, from :func:`check_settings`), the mean realised ratio, every
    step's realised ratio and top-K, and the mean attention FLOPs relative to dense."""
    if plan is None:
        realised, top_k = preview_head_activation(pipe.transformer, settings.head_activation_ratio)
        return {"realised_head_activation_ratio": realised, "top_k_per_layer": top_k}
    return {"realised_head_activation_ratio": plan.mean_ratio, "top_k_per_layer": None,
            "head_activation_schedule": plan.spec, "head_activation_ratios": plan.realised,
            "top_k_per_step": plan.top_k, "mean_attention_flop_ratio": plan.mean_attention_flop_ratio}


def sampler_record(args: argparse.Namespace, pipe) -> dict[str, str]:
    """How this run's sampler differs from ``pipe(...)`` on the loaded pipeline with its defaults:
    the scheduler (kept or built here) and the guidance, each as one sentence for the log and
    for ``sample_config.json``."""
    name = type(pipe.scheduler).__name__
    if args.scheduler in (None, "saved") and (model_folder(args.model) / "model_index.json").is_file():
        scheduler = f"the pipeline folder's own {name}"
    else:
        scheduler = f"{name} from make_scheduler({args.scheduler or 'ddpm'!r}) (not a saved scheduler)"
    defaults = inspect.signature(type(pipe).__call__).parameters
    scale, channels = defaults["guidance_scale"].default, defaults["guidance_channels"].default
    guidance = f"guidance_scale {args.guidance_scale} on {args.guidance_channels!r} eps channels"
    if (args.guidance_scale, args.guidance_channels) != (scale, channels):
        guidance += f" (pipe() defaults to {scale} on {channels!r}; --guidance-scale / --guidance-channels)"
    return {"scheduler": scheduler, "guidance": guidance}


@command
def main(args: argparse.Namespace) -> int:
    check_args(args)
    settings = SampleSettings(
        num_samples=args.num_samples, guidance_scale=args.guidance_scale, guidance_channels=args.guidance_channels,
        num_inference_steps=args.num_inference_steps, head_activation_ratio=args.head_activation_ratio,
        seed=args.seed, class_labels=args.class_labels,
    )
    accelerator = Accelerator()
    clip = {"auto": None, "yes": True, "no": False}[args.clip_sample]
    pipe = load_pipeline(args.model, vae=args.vae, scheduler=args.scheduler, clip_sample=clip, dtype=args.dtype)
    plan = check_settings(pipe, settings)  # the pipeline's one check of the run's call, before anything is written
    if not args.no_npz:
        check_npz_fits_on_disk(args.output_dir, pipe, settings.num_samples)
    identity = run_identity(pipe, settings, args.model)
    run_info = {
        "args": vars(args),
        "sampler": sampler_record(args, pipe),
        "num_samples": settings.num_samples,
        "num_processes": accelerator.num_processes,
        "per_device_batch_size": args.per_device_batch_size,
        **head_activation_record(pipe, settings, plan),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.dry_run:
        if accelerator.is_main_process:
            print(json.dumps({"identity": identity, "run": run_info}, indent=2, sort_keys=True))
        return 0
    # One writer per output folder: a second command sampling into it stops here, naming this one.
    # The main process holds the lock for the whole run; the other processes are part of it.
    held = (hold_output_folder(args.output_dir, "sample") if accelerator.is_main_process
            else contextlib.nullcontext())
    with held:
        write_samples(args, accelerator, pipe, settings, identity, run_info)
    return 0


def write_samples(args: argparse.Namespace, accelerator: Accelerator, pipe, settings: SampleSettings,
                  identity: dict, run_info: dict) -> None:
    """The run itself, once every check has passed: the settings file, the missing PNGs (all
    processes), and the ``.npz`` (the main process, which makes any damaged PNG again)."""
    sampler, realised = run_info["sampler"], run_info["realised_head_activation_ratio"]
    if accelerator.is_main_process:
        note = check_or_write_settings(args.output_dir, identity, run_info)
        if note:
            logger.info(f"note: {note}")
        logger.info(f"scheduler: {sampler['scheduler']}; {sampler['guidance']}.")
    accelerator.wait_for_everyone()

    pipe.to(accelerator.device)
    if args.compile:
        compile_model(pipe.transformer, mode=args.compile_mode, dynamic=None)  # None: a last, smaller batch is fine
    start = time.perf_counter()
    made = sample_images(
        pipe, args.output_dir, settings, batch_size=args.per_device_batch_size,
        rank=accelerator.process_index, world_size=accelerator.num_processes,
        progress=accelerator.is_local_main_process and info_enabled(),
    )
    elapsed = time.perf_counter() - start
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    schedule = run_info.get("head_activation_schedule")
    activation = f"head activation {realised:.4f}" if schedule is None else \
        f"head activation schedule {schedule}, mean realised ratio {realised:.4f}"
    logger.info(f"{made} images generated by rank 0 this run ({activation}).")
    if made:
        logger.info(f"Speed: {made / elapsed:.3g} images/s on rank 0 ({elapsed:.1f} s, "
                    f"{'compiled' if args.compile else 'eager'} transformer, {args.dtype}).")
    if not args.no_npz:
        def remake(index: int, path: Path) -> None:
            logger.warning(f"{path} is damaged (it cannot be decoded); making image {index} again.")
            remake_image(pipe, args.output_dir, settings, index)

        labels = ClassLabels(settings.num_samples, pipe.transformer.config.num_classes, settings.class_labels,
                             settings.seed)
        path = write_adm_npz(args.output_dir, settings.num_samples, labels=labels, on_damaged=remake)
        logger.info(f"Wrote {path} ({settings.num_samples} images in arr_0, their class labels in arr_1).")


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry: clear one-line errors on stderr and a non-zero exit status."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    sys.exit(cli())
