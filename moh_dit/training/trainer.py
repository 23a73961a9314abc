"""``train``: one run, top to bottom -- set up, resume, loop, checkpoint, finish.

:func:`train` reads in the order a run happens. Set up: check the options and the launch,
decide where the run starts (:func:`~.checkpoints.find_start`: is the folder busy, whose run
is it, which checkpoint), build the data, the latent space, the model, the EMA, optimiser and
schedule. Resume (:func:`~.checkpoints.resume`): the model must be the run's, then the
checkpoint's state; then the folder is claimed (its lock) and the run recorded. Loop: one
optimiser step per batch, then its log, sample grid (with a MoH model's head-usage figure) and
checkpoint. Finish: export ``OUT/final``, a pipeline folder (transformer, scheduler, VAE, class
names). Everything that can refuse the run happens before anything is written; the run
folder's decisions are the main process's, handed to all (:func:`~.checkpoints.on_main`).

The state of a run is in two objects: :class:`~.checkpoints.Parts` (model, EMA, optimiser,
LR schedule and :class:`~.checkpoints.TrainState`: step and data position), which a
checkpoint saves and restores, and the model as accelerate prepared it, through which
forward and backward go. The order of random draws in the loop is the one a resumed run
replays, so nothing here may add, drop or reorder one.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from ..data.datasets import ImageFolderDataset, ResumableSampler, collate_skip_corrupt, write_class_index
from ..data.latents import LatentDataset, load_vae, vae_downsample_factor
from ..diffusion.gaussian_diffusion import create_diffusion
from ..diffusion.schedulers import make_scheduler
from ..errors import InputNotFound, InvalidInput, OutputExists, TrainingDiverged
from ..models.presets import get_preset, resolve_layer_layout
from ..models.transformer_moh_dit import MoHDiTTransformer2DModel
from ..pipelines.pipeline_moh_dit import MoHDiTPipeline
from ..utils.io import atomic_write, naming_write_errors, publish_folder
from ..utils.output_folders import hold_output_folder, lock_path, marked_by, write_output_marker
from ..utils.logging import get_logger, info_enabled
from ..utils.runtime import set_tf32
from ..utils.speed import compile_model, peak_flops, training_flops_per_image
from .checkpoints import (Parts, Start, TrainState, everywhere, find_start, interrupted, normalized, on_main,
                          record_run, resume, run_identity, save_checkpoint)
from .config import DEFAULT_GLOBAL_BATCH_SIZE, TrainConfig, check_batch_memory, model_dir, warn
from .schedules import build_lr_scheduler, ema_decay_at
from .tracking import last_logged_usage, log_images, log_with, resolve_report_to, save_head_usage_figure

logger = get_logger(__name__)


def train(cfg: TrainConfig) -> Path:
    """Train the model of ``cfg`` (its preset; without one, the ``init_from`` folder's or the
    resumed run's architecture) and return the folder of the exported EMA model (``OUT/final``).
    Every process runs every line; the main process holds the folder's lock (``.OUT.lock``
    beside it, as every command that writes a folder does) from its first look at the folder
    to the end, however the run ends."""
    from accelerate.utils import set_seed

    accelerator, cfg = _start_accelerator(cfg)  # cfg from here on: with what the launch decided
    with contextlib.ExitStack() as held:
        # Set up, reading only until the folder is claimed: a refused run leaves it as it was.
        def first_look() -> Start:  # the main process's: take the folder, then whose run? where from?
            held.enter_context(hold_output_folder(cfg.output_dir, "train"))
            _check_writer(Path(cfg.output_dir))
            return find_start(cfg)

        start = on_main(accelerator, first_look)
        cfg = start.cfg  # a resume without a preset: the run's
        if accelerator.device.type == "cuda":
            set_tf32(cfg.allow_tf32)
        set_seed(cfg.seed, device_specific=True)
        data = _build_data(cfg, accelerator)  # validated before any model or VAE work
        space = _build_latent_space(cfg, data.dataset, accelerator.device)
        model, model_config = _build_model(cfg, space, data.classes, (start.recorded or {}).get("model_config"))
        parts, model = _build_optimisation(cfg, accelerator, model, data.sampler)
        diffusion = create_diffusion()
        flops_per_image, device_peak = _mfu_terms(cfg, accelerator, parts.model)

        # Resume (the model must be the run's; then the checkpoint's state, if any), then claim
        # the folder and record the run: the first writes.
        resume(parts, start, model_config)
        if start.folder is not None:
            _say(accelerator, f"Resumed from {start.folder} at step {parts.state.step}.")
        run = {"run_id": start.run_id, **run_identity(cfg), "model_config": model_config}  # in every marker
        facts = {"run_id": start.run_id, "data_path": run["data_path"], "num_processes": accelerator.num_processes,
                 "per_process_batch_size": data.per_process, "latent_shape": list(space.shape),
                 "model_config": model_config}
        on_main(accelerator, lambda: _record(start, facts, data.class_to_idx, parts.state.step))
        if cfg.report_to != "none":
            accelerator.init_trackers("moh-dit", config={k: v for k, v in dataclasses.asdict(cfg).items()
                                                         if isinstance(v, (int, float, str, bool))})

        # Loop, to cfg.max_steps optimiser steps of cfg.gradient_accumulation_steps batches each.
        # The loss is checked for NaN/inf at the steps that log, sample or checkpoint, before
        # anything is written; in between, nothing waits for the device.
        state, batches = parts.state, data.batches()
        log, watch = _TrainLog(cfg, parts, flops_per_image, device_peak), _DivergenceWatch(accelerator.device)
        last_checkpoint = start.folder  # what a divergence names until the first checkpoint of this start
        while state.step < cfg.max_steps:
            micro_batches = [_next_batch(batches, data, space, state, accelerator.device)
                             for _ in range(cfg.gradient_accumulation_steps)]
            log_now = (state.step + 1) % cfg.log_every == 0 or state.step + 1 == cfg.max_steps
            step = _train_step(cfg, parts, model, diffusion, micro_batches, log_now)
            watch.update(state.step, step)
            log.add(step)
            sample_now = bool(cfg.sample_every) and state.step % cfg.sample_every == 0
            checkpoint_now = state.step % cfg.checkpoint_every == 0 or state.step == cfg.max_steps
            if log_now or sample_now or checkpoint_now:  # on every process: the check is collective
                _stop_if_diverged(accelerator, watch, last_checkpoint)
            if log_now:
                log.write(step)
            if sample_now and accelerator.is_main_process:
                _save_sample_grid(cfg, parts, diffusion, space, len(data.classes))
                if log.latest_usage is not None:  # beside the grid: samples/head_usage_step-N.png
                    save_head_usage_figure(accelerator, log.latest_usage, parts.model.layer_shared,
                                           parts.model.trained_top_k, state.step, Path(cfg.output_dir) / "samples"
                                           / f"head_usage_step-{state.step:07d}.png")
            if checkpoint_now:
                last_checkpoint = save_checkpoint(parts, cfg, state.step, run)
        log.close()

        # Finish: OUT/final, a pipeline folder.
        return _export_final(cfg, parts, space, data.class_to_idx)


def preflight(cfg: TrainConfig) -> str:
    """Validate ``cfg`` and check its run folder as :func:`train` would, writing nothing and
    leaving nothing behind (a dry run); returns what ``train`` would do. A folder that another
    command writes, or that another command wrote, is refused as ``train`` would refuse it."""
    cfg.validate()
    resolved = cfg.resolved()
    # The batch of one process (the launch's number of processes is not known here).
    check_batch_memory(resolved, cfg.train_batch_size or max(1, (cfg.global_batch_size or DEFAULT_GLOBAL_BATCH_SIZE)
                                                              // resolved.gradient_accumulation_steps))
    out = Path(cfg.output_dir)
    # Held only while the folder is read, and only where its lock can already be (beside it): a
    # dry run creates no folder, but refuses one that another command is building.
    with hold_output_folder(out, "train") if lock_path(out).parent.is_dir() else contextlib.nullcontext():
        _check_writer(out)
        start = find_start(resolved)  # with the VAE the run would use, as train's decision has it
    if cfg.ema_warning() is not None:
        warn(cfg.ema_warning())
    if start.folder is not None:
        return f"would resume from {start.folder} (step {start.step})"
    return start.note or ("would start a new run" if cfg.resume is None else "would start from scratch")


# --------------------------------------------------------------------------------------
# The run folder
# --------------------------------------------------------------------------------------


def _check_writer(out: Path) -> None:
    """A run folder is new, a folder of the user's, or one that training wrote: the output of
    another command (a sample folder, an export) is refused, so that training never mixes its
    files with another command's."""
    writer = marked_by(out) if out.is_dir() else None
    if writer not in (None, "moh-dit train"):
        raise OutputExists(f"output_dir {out} was written by {writer}, not by training; choose another output_dir.",
                           parameters="output_dir")


def _record(start: Start, facts: dict[str, Any], class_to_idx: dict[str, int], step: int) -> None:
    """On the main process, once the run's state has loaded: record the run (the first write)
    and say what changed."""
    if start.note is not None:
        logger.info(start.note)
    changed = record_run(start.cfg, facts, class_to_idx, step)  # start.cfg: as the launch decided it
    if changed:
        logger.info(f"Settings changed from step {step} on (train_config.json keeps every segment's under "
                    f"segments): {'; '.join(changed)}.")


# --------------------------------------------------------------------------------------
# Set up
# --------------------------------------------------------------------------------------


def _say(accelerator, message: str) -> None:
    """An info line of the run, once (from the main process)."""
    if accelerator.is_main_process:
        logger.info(message)


def _start_accelerator(cfg: TrainConfig) -> tuple[Any, TrainConfig]:
    """The Accelerator of this launch and ``cfg`` with what the launch decided (precision,
    accumulation, batch split, tracker), once ``cfg`` passed its checks, its batch splits over
    the launch's processes and fits in memory, and the launch is one this trainer's checkpoints
    support (plain data-parallel). ``mixed_precision`` left out is accelerate's to decide, as in
    diffusers' scripts (accelerate launch's option or config); the accumulation is
    :meth:`TrainConfig.accumulation`'s."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    cfg.validate()  # before the Accelerator, which would otherwise report bad options in its own terms
    accumulation_source = cfg.accumulation()[1]
    cfg = cfg.resolved()  # the image size and VAE of a latent cache are the cache's; the accumulation
    report_to, tracker_source = resolve_report_to(cfg.report_to)
    if cfg.mixed_precision is not None:
        precision_source = "mixed_precision"
    elif os.environ.get("ACCELERATE_MIXED_PRECISION"):
        precision_source = "accelerate's ACCELERATE_MIXED_PRECISION, from accelerate launch or its config"
    else:
        precision_source = "accelerate's default; set it with mixed_precision or accelerate launch's option"
    accelerator = Accelerator(
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        log_with=log_with(report_to),
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / "logs")),
    )
    cfg = cfg.for_launch(accelerator.num_processes, accelerator.mixed_precision,
                         accelerator.gradient_accumulation_steps, report_to)
    # Each process's machine may have another amount of memory: all stop if any must.
    everywhere(accelerator, lambda: check_batch_memory(cfg, cfg.train_batch_size))
    kind = str(accelerator.distributed_type).upper()
    if any(name in kind for name in ("DEEPSPEED", "FSDP", "MEGATRON")):
        raise InvalidInput(f"accelerate's {accelerator.distributed_type} is not supported by this trainer's "
                           "checkpoints; launch plain data-parallel (accelerate launch's multi-GPU mode, or torchrun).")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and accelerator.num_processes == 1:
        # Every launched process would train alone (and all but one would find the folder busy).
        raise InvalidInput(f"launched as {world} processes (WORLD_SIZE={world}) but accelerate sees one; on CPU set "
                           "ACCELERATE_USE_CPU=1 for torchrun, or use accelerate launch's CPU mode.")
    if accelerator.is_main_process:
        _announce_launch(cfg, accelerator.num_processes, precision_source, accumulation_source, tracker_source)
    return accelerator, cfg


def _announce_launch(cfg: TrainConfig, num_processes: int, precision_source: str, accumulation_source: str,
                     tracker_source: str) -> None:
    """What the launch decided, and the EMA warning of a run whose EMA would not follow training."""
    logger.info(f"Mixed precision: {cfg.mixed_precision} ({precision_source}).")
    logger.info(f"Batch: {cfg.global_batch_size} images per step = {cfg.train_batch_size} per process x "
                f"{num_processes} processes x {cfg.gradient_accumulation_steps} accumulation steps (accumulation: "
                f"{accumulation_source}).")
    logger.info(f"Tracker: {cfg.report_to} ({tracker_source}).")
    ema_warning = cfg.ema_warning()
    if ema_warning is not None:
        warn(ema_warning)


@dataclass
class _Data:
    """The dataset, its classes, and this process's share of it."""

    dataset: Any
    classes: list[str]
    class_to_idx: dict[str, int]
    sampler: ResumableSampler
    per_process: int
    loader_kwargs: dict[str, Any]

    def batches(self):
        """Batches without end (the loop stops by step count)."""
        loader = DataLoader(self.dataset, **self.loader_kwargs)
        while True:
            yield from loader


def _build_data(cfg: TrainConfig, accelerator) -> _Data:
    if cfg.latents_dir is not None:
        dataset = LatentDataset(cfg.latents_dir, random_flip=cfg.random_flip, seed=cfg.seed)
    else:
        dataset = ImageFolderDataset(
            cfg.data_dir, cfg.image_size, random_flip=cfg.random_flip, seed=cfg.seed, on_corrupt=cfg.on_corrupt
        )
    per_process = cfg.train_batch_size  # one forward pass of this process
    sampler = ResumableSampler(len(dataset), num_replicas=accelerator.num_processes,
                               rank=accelerator.process_index, seed=cfg.seed)
    # A private generator: DataLoader iterators draw a seed from the global RNG otherwise,
    # which would shift every later random number after a resume.
    loader_kwargs = dict(batch_size=per_process, sampler=sampler, num_workers=cfg.num_workers, drop_last=False,
                         generator=torch.Generator(), pin_memory=accelerator.device.type == "cuda",
                         persistent_workers=False)
    if cfg.on_corrupt == "skip":
        loader_kwargs["collate_fn"] = collate_skip_corrupt
    return _Data(dataset, dataset.classes, dataset.class_to_idx, sampler, per_process, loader_kwargs)


@dataclass
class LatentSpace:
    """What the model denoises: latents of ``vae`` scaled by ``scaling`` (encoded on the fly),
    a latent cache's (``vae`` None, already scaled), or pixels (both None). ``decoder`` turns
    latents into images (the sample grids, and final/'s pipeline): ``vae``, or the cache's VAE."""

    shape: tuple[int, int, int]  # (C, h, w)
    vae: Any | None
    scaling: float | None
    decoder: Any | None = None


def _build_latent_space(cfg: TrainConfig, dataset, device: torch.device) -> LatentSpace:
    """A latent cache's space, pixels (``vae="none"``), or the VAE's latents (the VAE loaded here)."""
    if cfg.latents_dir is not None:
        # The VAE the cache was made with: final/ saves it as the pipeline's vae, and the sample
        # grids decode with it. Loaded now, so that a missing one stops the run before any work.
        if not cfg.vae:
            raise InvalidInput(f"latents_dir {cfg.latents_dir} does not record its VAE, which final/ saves as the "
                               "pipeline's VAE; give it as vae.", parameters=("latents_dir", "vae"))
        try:
            decoder = load_vae(cfg.vae, cfg.vae_subfolder, device=device)
        except FileNotFoundError as error:
            raise InputNotFound(f"{error} final/ saves the VAE of latents_dir {cfg.latents_dir} as the pipeline's "
                               "VAE: make it available (a local folder as vae).",
                               parameters=("latents_dir", "vae")) from None
        return LatentSpace(tuple(dataset.latent_shape), None, dataset.scaling_factor, decoder)
    if cfg.pixel_space:
        return LatentSpace((3, cfg.image_size, cfg.image_size), None, None)
    vae = load_vae(cfg.vae, cfg.vae_subfolder, device=device)
    factor = vae_downsample_factor(vae)
    if cfg.image_size % factor:
        raise InvalidInput(f"image_size {cfg.image_size} is not divisible by the VAE's downsampling factor {factor}.",
                           parameters="image_size")
    size = cfg.image_size // factor
    return LatentSpace((vae.config.latent_channels, size, size), vae, vae.config.scaling_factor, vae)


def _build_model(cfg: TrainConfig, space: LatentSpace, classes: list[str], recorded: dict | None):
    """The run's model for this data (:func:`_architecture`; ``recorded``: the model config of
    the run a resume continues), and its config as the run records it."""
    overrides = dict(cfg.model_overrides)
    overrides.update(sample_size=space.shape[1], in_channels=space.shape[0], num_classes=len(classes),
                     class_dropout_prob=cfg.class_dropout, class_names=list(classes))
    model = MoHDiTTransformer2DModel(**{**_architecture(cfg, recorded), **overrides})
    if cfg.router_warmup_steps and not model.is_moh:  # a preset's is refused by TrainConfig.validate
        raise InvalidInput(f"router_warmup_steps {cfg.router_warmup_steps}: {_model_source(cfg)} is a dense DiT "
                           "without routers; drop router_warmup_steps.",
                           parameters=("router_warmup_steps", "preset", "init_from"))
    model_config = normalized({k: v for k, v in dict(model.config).items() if not k.startswith("_")})
    if cfg.init_from is not None:
        _load_init_weights(cfg, model, model_config)
    return model, model_config


def _model_source(cfg: TrainConfig) -> str:
    """Where the run's architecture comes from, in a message's words."""
    if cfg.preset is not None:
        return f"preset {cfg.preset}"
    return f"the model of init_from {cfg.init_from}" if cfg.init_from is not None else "the resumed run's model"


def _architecture(cfg: TrainConfig, recorded: dict | None) -> dict[str, Any]:
    """The model's constructor arguments before the data's: ``preset``'s; without it, those
    of the ``init_from`` folder's config.json (an upcycled layout has no preset), else those
    the resumed run recorded."""
    if cfg.preset is not None:
        return get_preset(cfg.preset)
    if cfg.init_from is not None:
        try:
            config = MoHDiTTransformer2DModel.load_config(model_dir(cfg.init_from))
        except (OSError, ValueError) as error:
            raise InvalidInput(f"init_from {cfg.init_from}: cannot read its config.json ({type(error).__name__}: "
                               f"{str(error).splitlines()[0] if str(error) else ''}).", parameters="init_from") from None
        kind = config.get("_class_name", MoHDiTTransformer2DModel.__name__)
        if kind != MoHDiTTransformer2DModel.__name__:
            raise InvalidInput(f"init_from {cfg.init_from} holds a {kind}, not a MoHDiTTransformer2DModel; give a "
                               "folder written by moh-dit upcycle, moh-dit convert or a run's final/.",
                               parameters="init_from")
    elif recorded is not None:
        config = recorded
    else:  # find_start refuses a resume without a preset or a recorded model
        raise InvalidInput("no preset, init_from or recorded model to build the run's model from.",
                           parameters=("preset", "init_from"))
    accepted = inspect.signature(MoHDiTTransformer2DModel.__init__).parameters
    return {k: v for k, v in config.items() if k in accepted and k != "self"}


# Settings of a saved model that init_from may differ in: the run sets them from its data and options.
_INIT_FREE_KEYS = ("class_names", "class_dropout_prob")


def _per_layer_config(config: dict) -> dict:
    """``config`` with heads, shared heads and top-K as per-layer lists (4 heads == [4] * layers)."""
    heads, shared, k = resolve_layer_layout(config["num_layers"], config["num_attention_heads"],
                                            config.get("num_shared_heads"), config.get("top_k"))
    return {**config, "num_attention_heads": heads, "num_shared_heads": shared, "top_k": k}


def _load_init_weights(cfg: TrainConfig, model: MoHDiTTransformer2DModel, model_config: dict) -> None:
    """``init_from``: the saved model's weights into ``model``, once its layout is the one
    the preset builds for this data (every constructor argument but class names and dropout)."""
    try:
        source = MoHDiTTransformer2DModel.from_pretrained(model_dir(cfg.init_from))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InvalidInput(f"init_from {cfg.init_from}: cannot load the model ({type(error).__name__}: "
                           f"{str(error).splitlines()[0] if str(error) else ''}).", parameters="init_from") from None
    theirs = _per_layer_config(normalized({k: v for k, v in dict(source.config).items() if not k.startswith("_")}))
    ours = _per_layer_config(model_config)
    diffs = [f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in sorted(set(theirs) | set(ours))
             if k not in _INIT_FREE_KEYS and theirs.get(k) != ours.get(k)]
    if diffs:
        if cfg.preset is None:
            raise InvalidInput(f"init_from {cfg.init_from} does not fit this data: {'; '.join(diffs)}. Train it on "
                               "data of its image size, channels and class count.", parameters="init_from")
        raise InvalidInput(f"init_from {cfg.init_from} does not fit preset {cfg.preset} on this data: "
                           f"{'; '.join(diffs)}. Leave preset out (the folder's config.json gives the architecture), "
                           "or give the one the model was made for, and data of its size and classes.",
                           parameters=("init_from", "preset"))
    names = theirs.get("class_names")
    if names is not None and names != model_config.get("class_names"):
        warn(f"init_from {cfg.init_from} was trained with classes {names[:5]}..., this data's are "
             f"{(model_config.get('class_names') or [])[:5]}...; class ids keep their embeddings.")
    model.load_state_dict(source.state_dict(), strict=True)


def _build_optimisation(cfg: TrainConfig, accelerator, model, sampler: ResumableSampler):
    """EMA (an exact copy of the initial model), AdamW prepared by accelerate, and the LR
    schedule: the :class:`Parts` a checkpoint saves, and the model as accelerate prepared it."""
    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    ema = copy.deepcopy(model).to(accelerator.device).requires_grad_(False).eval()
    model.train()
    if cfg.compile:  # in place, after the EMA copy: state-dict keys stay the model's own
        compile_model(model, mode=cfg.compile_mode, per_block=cfg.compile_per_block)
    # The fused kernel (one launch for all parameters) where the device has it; else torch's default.
    fused = {"fused": True} if accelerator.device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  betas=tuple(cfg.adam_betas), **fused)
    model, optimizer = accelerator.prepare(model, optimizer)
    # Not prepared: accelerate would step it once per process; here it steps once per optimiser step.
    lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, optimizer, cfg.warmup_steps, cfg.max_steps)
    # EMA and step/data position are saved by this package (safetensors + JSON), not
    # registered with accelerate, whose custom state is a pickle loaded with weights_only=False.
    parts = Parts(accelerator, accelerator.unwrap_model(model), ema, optimizer, lr_scheduler, TrainState(sampler))
    return parts, model


def _mfu_terms(cfg: TrainConfig, accelerator, model) -> tuple[int, float]:
    """One training step's FLOPs per image and one device's peak FLOP/s (a datasheet figure
    for known GPUs, else a timed matmul: said once at the start), for the MFU in the logs."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.mixed_precision, torch.float32)
    peak, source = peak_flops(accelerator.device, dtype, allow_tf32=cfg.allow_tf32)
    _say(accelerator, f"MFU is measured against the {source}.")
    return training_flops_per_image(model), peak


# --------------------------------------------------------------------------------------
# The loop: a batch, a step, the divergence check, the log, the sample grid
# --------------------------------------------------------------------------------------


@dataclass
class _Step:
    """One step's terms, detached, for the log window."""

    loss: torch.Tensor
    mse: torch.Tensor
    vb: torch.Tensor
    lb: torch.Tensor
    grad_norm: Any  # a tensor, or a float from accelerate's clipping
    head_usage: list[torch.Tensor] | None


class _DivergenceWatch:
    """The first step whose loss was NaN/inf on this process, and its terms, kept on the
    device: updating it costs a few tiny kernels and no host sync, so the step loop never
    waits for the GPU. :func:`_stop_if_diverged` reads it at the log, sample and checkpoint
    steps, before anything is written."""

    def __init__(self, device: torch.device):
        self.first = torch.full((), -1, dtype=torch.long, device=device)  # step number, -1: none yet
        self.terms = torch.zeros(4, dtype=torch.float32, device=device)  # loss, mse, vb, lb at that step

    def update(self, step_number: int, step: "_Step") -> None:
        new = (self.first < 0) & ~torch.isfinite(step.loss)
        self.first = torch.where(new, step_number, self.first)
        values = torch.stack([step.loss.float(), step.mse.float(), step.vb.float(), step.lb.float()])
        self.terms = torch.where(new, values, self.terms)


def _next_batch(batches: Iterator, data: _Data, space: LatentSpace, state: TrainState,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The next batch on the device, the data position advanced, latents encoded if a VAE is in use."""
    x, y = next(batches)
    num_classes = len(data.classes)
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):  # on the host, before the copy
        raise InvalidInput(f"the data gave class ids in [{int(y.min())}, {int(y.max())}], outside [0, "
                         f"{num_classes - 1}]: the dataset and the model's classes disagree.")
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    data.sampler.advance(data.per_process)
    state.images_skipped += data.per_process - x.shape[0]  # unreadable images dropped (on_corrupt="skip")
    if space.vae is not None:
        with torch.no_grad():
            shift = getattr(space.vae.config, "shift_factor", None) or 0.0
            x = (space.vae.encode(x).latent_dist.sample() - shift) * space.scaling
    return x, y


def label_drop_mask(labels: torch.Tensor, probability: float) -> torch.Tensor:
    """(B,) bool: which labels of the batch train as the null class (label dropout for
    classifier-free guidance), drawn here, in eager code, from torch's generator. The model
    gets it as ``force_drop_ids`` and draws nothing: a compiled forward would draw from the
    compiler's generator instead, and a compiled run would then neither follow an eager one
    with the same seed nor resume one. The draw is diffusers' ``LabelEmbedding.token_drop``'s
    (one uniform per label, on the labels' device), at the point of the random stream where
    the model drew it, so runs keep the losses they had when the model drew it. Without
    dropout nothing is drawn, as the model drew nothing."""
    if probability <= 0:
        return torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    return torch.rand(labels.shape[0], device=labels.device) < probability


def _train_step(cfg: TrainConfig, parts: Parts, model: torch.nn.Module, diffusion,
                micro_batches: list[tuple[torch.Tensor, torch.Tensor]], log_now: bool) -> _Step:
    """One optimiser step through ``model`` (as accelerate prepared it): for each (x, y) of
    ``micro_batches``, diffusion loss plus ``lb_coeff`` times the load-balance loss and its
    backward (accelerate divides it by their number, so the gradient is the mean over all of
    them, as one batch would give; gradients are all-reduced at the last only); then
    clipping, AdamW, the LR schedule and the EMA."""
    acc = parts.accelerator
    sums = torch.zeros(4, device=acc.device)  # loss, mse, vb, lb: means over the micro-batches
    for i, (x, y) in enumerate(micro_batches):
        with acc.accumulate(model):
            t = diffusion.sample_timesteps(x.shape[0], device=acc.device)
            noise = torch.randn_like(x)
            x_t = diffusion.q_sample(x, t, noise)
            drop = label_drop_mask(y, cfg.class_dropout)
            head_usage = log_now and parts.model.is_moh and i == len(micro_batches) - 1
            with acc.autocast():
                out = model(x_t, t, y, output_load_balance_loss=True, output_head_usage=head_usage,
                            force_drop_ids=drop)
            terms = diffusion.training_losses(out.sample, x, x_t, t, noise)
            loss = terms["loss"].mean() + cfg.lb_coeff * out.load_balance_loss
            acc.backward(loss)
        sums += torch.stack([loss.detach(), terms["mse"].mean().detach(), terms["vb"].mean().detach(),
                             out.load_balance_loss.detach()]).float()
    if parts.state.step < cfg.router_warmup_steps:
        # Router warm-up: the other parameters get no gradient, so AdamW skips them entirely
        # (no moment, no step count, no weight decay); their first update comes after it.
        for name, param in model.named_parameters():
            if ".router_" not in name:
                param.grad = None
    grad_norm = acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
    parts.optimizer.step()
    parts.lr_scheduler.step()
    parts.optimizer.zero_grad(set_to_none=True)
    update_ema(parts.ema, parts.model, ema_decay_at(parts.state.step + 1, cfg.ema_decay, cfg.ema_warmup,
                                                     cfg.ema_inv_gamma, cfg.ema_power))
    parts.state.step += 1
    parts.state.images_seen += cfg.global_batch_size
    loss, mse, vb, lb = (sums / len(micro_batches)).unbind()
    return _Step(loss, mse, vb, lb, grad_norm, out.head_usage)


def _stop_if_diverged(accelerator, watch: _DivergenceWatch, last_checkpoint: str | Path | None) -> None:
    """Raise TrainingDiverged on every process if the loss was NaN/inf at any step so
    far on any of them, naming the first such step and ``last_checkpoint`` (one host sync,
    at log, sample and checkpoint steps only)."""
    first = watch.first.reshape(1)
    terms = watch.terms.reshape(1, 4)
    if accelerator.num_processes > 1:  # decided together: a rank that stopped alone would leave the others waiting
        first, terms = accelerator.gather(first), accelerator.gather(terms)
    steps = first.tolist()
    bad = [(step, rank) for rank, step in enumerate(steps) if step >= 0]
    if not bad:
        return
    step, rank = min(bad)
    loss, mse, vb, lb = terms[rank].tolist()
    where = f" on process {rank}" if accelerator.num_processes > 1 else ""
    raise TrainingDiverged(
        f"The loss became {loss} at step {step}{where} (mse {mse:.4g}, vb {vb:.4g}, lb {lb:.4g}). "
        f"The last good checkpoint is {last_checkpoint or 'none'}; lower learning_rate, set max_grad_norm, "
        "or use bf16 instead of fp16, then resume.", parameters=("learning_rate", "max_grad_norm"))


class _TrainLog:
    """Sums over the steps since the last log (on-device tensors until the log reduces them),
    and where a log goes: the trackers, the progress bar, train_log.jsonl and head_usage.jsonl."""

    def __init__(self, cfg: TrainConfig, parts: Parts, flops_per_image: int | None, peak_flops: float | None):
        self.cfg, self.parts, self.flops_per_image, self.peak_flops = cfg, parts, flops_per_image, peak_flops
        self.progress = None
        # (step, per-layer usage) logged last, for the head-usage figure at sample steps (main process)
        self.latest_usage = None
        if parts.accelerator.is_main_process:
            if parts.model.is_moh:
                self.latest_usage = last_logged_usage(Path(cfg.output_dir) / "head_usage.jsonl")
            from tqdm.auto import tqdm

            self.progress = tqdm(total=cfg.max_steps, initial=parts.state.step, desc="train", dynamic_ncols=True,
                                 disable=not info_enabled())  # hidden with info lines, as every command's bars
        self._new_window()

    def _new_window(self) -> None:
        self.sums: dict[str, Any] = {"loss": 0.0, "mse": 0.0, "vb": 0.0, "lb": 0.0, "grad_norm": 0.0}
        self.count, self.images, self.start = 0, 0, time.perf_counter()

    def add(self, step: _Step) -> None:
        self.images += self.cfg.global_batch_size
        self.sums["loss"] += step.loss
        self.sums["mse"] += step.mse
        self.sums["vb"] += step.vb
        self.sums["lb"] += step.lb
        self.sums["grad_norm"] += step.grad_norm.detach() if torch.is_tensor(step.grad_norm) else step.grad_norm
        self.count += 1
        if self.progress is not None:
            self.progress.update(1)

    def write(self, step: _Step) -> None:
        """Averages over all processes of the steps since the last log, speed, MFU, LR and
        skipped images; then a new window starts."""
        acc, state = self.parts.accelerator, self.parts.state
        elapsed = time.perf_counter() - self.start
        logs = {k: float(acc.reduce(torch.as_tensor(v, device=acc.device, dtype=torch.float32), "mean")) / self.count
                for k, v in self.sums.items()}
        logs.update(steps_per_sec=self.count / elapsed, images_per_sec=self.images / elapsed,
                    lr=self.parts.lr_scheduler.get_last_lr()[0], images_skipped=state.images_skipped)
        if self.flops_per_image and self.peak_flops:
            logs["mfu"] = logs["images_per_sec"] * self.flops_per_image / (self.peak_flops * acc.num_processes)
        if self.parts.model.is_moh and step.head_usage is not None:
            self._head_balance(step.head_usage, logs)
        if self.cfg.report_to != "none":
            acc.log(logs, step=state.step)
        if self.progress is not None:
            speed = {"it_s": f"{logs['steps_per_sec']:.2f}", "img_s": f"{logs['images_per_sec']:.1f}"}
            if "mfu" in logs:
                speed["mfu"] = f"{100 * logs['mfu']:.1f}%"
            self.progress.set_postfix(loss=f"{logs['loss']:.4f}", mse=f"{logs['mse']:.4f}", lb=f"{logs['lb']:.3f}",
                                      **speed)
            _append_line(Path(self.cfg.output_dir) / "train_log.jsonl", {"step": state.step, **logs})
        self._new_window()

    def _head_balance(self, head_usage: list[torch.Tensor], logs: dict[str, Any]) -> None:
        """Per-layer balance of the routed heads into ``logs``; the usage itself into head_usage.jsonl."""
        for i, usage in enumerate(head_usage):
            routed = usage[self.parts.model.layer_shared[i]:]
            if routed.numel() > 1:
                # coefficient of variation of routed-head usage: 0 = perfectly balanced
                logs[f"head_balance_cv/layer_{i:02d}"] = (routed.std() / routed.mean().clamp_min(1e-8)).item()
        if self.parts.accelerator.is_main_process:
            self.latest_usage = (self.parts.state.step, [u.tolist() for u in head_usage])
            _append_line(Path(self.cfg.output_dir) / "head_usage.jsonl",
                         {"step": self.latest_usage[0], "usage": self.latest_usage[1]})

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()


def _append_line(path: Path, entry: dict) -> None:
    """One JSON line at the end of a log; a failed write (a full disk) names the log."""
    with naming_write_errors(path), open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def _save_sample_grid(cfg: TrainConfig, parts: Parts, diffusion, space: LatentSpace, num_classes: int) -> None:
    """``OUT/samples/step-N.png``: an EMA sample grid, four rows of the same up to 16 classes
    and seeds at every sample step; also to the trackers that take images (``samples``)."""
    from torchvision.utils import make_grid, save_image

    images = sample_grid(parts.ema, diffusion, num_classes, space.shape, space.decoder, steps=cfg.sample_steps,
                         per_class=4, seed=cfg.seed, device=parts.accelerator.device)
    with atomic_write(Path(cfg.output_dir) / "samples" / f"step-{parts.state.step:07d}.png") as f:
        save_image(images, f, nrow=min(num_classes, 16), format="png")
    log_images(parts.accelerator, "samples", make_grid(images, nrow=min(num_classes, 16))[None], parts.state.step)


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * model (DiT's constant decay), as two multi-tensor
    ``torch._foreach_*`` updates over all parameters rather than two kernels per parameter.

    Same arithmetic as ``e.mul_(decay).add_(p, alpha=1 - decay)`` per parameter, so the result
    is bit-identical to that loop (``_foreach_lerp_`` would round differently and break the
    equality with runs that used the loop). Parameters are paired by name."""
    model_params = dict(model.named_parameters())
    ema_list, model_list = [], []
    for name, e in ema.named_parameters():
        p = model_params[name].detach()
        ema_list.append(e)
        model_list.append(p if p.dtype == e.dtype and p.device == e.device else p.to(e))
    if len(model_params) != len(ema_list):
        missing = sorted(set(model_params) - {n for n, _ in ema.named_parameters()})
        raise KeyError(f"the EMA model lacks parameters {missing[:3]}; it must be a copy of the model.")
    torch._foreach_mul_(ema_list, decay)
    torch._foreach_add_(ema_list, model_list, alpha=1 - decay)


@torch.no_grad()
def sample_grid(model, diffusion, num_classes: int, latent_shape, vae=None, steps: int = 50, per_class: int = 1,
                seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Images in [0, 1] (N, 3, H, W) from ``model`` with a respaced DDPM, one row per seed,
    classes in order (up to 16), no guidance. For monitoring, not evaluation."""
    sampler = diffusion.respace(steps)
    classes = list(range(min(num_classes, 16)))
    labels = torch.tensor(classes * per_class, device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn((len(labels), *latent_shape), generator=gen).to(device)
    timestep_map = sampler.timestep_map.to(device)
    for i in reversed(range(sampler.num_timesteps)):
        t = torch.full((len(labels),), i, device=device, dtype=torch.long)
        out = model(x, timestep_map[t], labels).sample
        noise = torch.randn(x.shape, generator=gen).to(device)
        # IDDPM clips the predicted image to [-1, 1] in pixel space; DiT does not clip latents.
        x = sampler.p_sample(out.float(), x.float(), t, noise=noise, clip_denoised=vae is None)["sample"]
    if vae is not None:
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        x = vae.decode(x / vae.config.scaling_factor + shift).sample
    return ((x.clamp(-1, 1) + 1) / 2).float().cpu()


# --------------------------------------------------------------------------------------
# Finish
# --------------------------------------------------------------------------------------


def _export_final(cfg: TrainConfig, parts: Parts, space: LatentSpace, class_to_idx: dict[str, int]) -> Path:
    """``OUT/final``: a pipeline folder in diffusers' layout -- the EMA model as ``transformer/``,
    the paper's DDPM as ``scheduler/``, the run's VAE as ``vae/`` (none for pixel space) and the
    class names as ``id2label`` -- with the class map, published whole by the main process."""
    accelerator = parts.accelerator
    if parts.state.images_skipped:
        _say(accelerator, f"Skipped {parts.state.images_skipped} unreadable images (on_corrupt='skip').")
    final = Path(cfg.output_dir) / "final"
    if accelerator.is_main_process:
        # IDDPM clips predicted images to [-1, 1] in pixel space; DiT does not clip latents.
        scheduler = make_scheduler("ddpm", clip_sample=space.decoder is None)
        pipe = MoHDiTPipeline(transformer=parts.ema, scheduler=scheduler, vae=space.decoder)
        # Replaces only this run's previous export: a refused start protects any other.
        try:
            with publish_folder(final, replace=True) as tmp:
                with naming_write_errors(final):  # a full disk names final/, not the temporary folder
                    pipe.save_pretrained(tmp, safe_serialization=True)
                    write_class_index(class_to_idx, tmp / "class_index.json")
                    write_output_marker(tmp, "train")
        except OSError as error:
            if error.errno is None:
                raise
            raise interrupted(error, f"{final} was not exported and the checkpoints are intact",
                              ", which exports it again") from error
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final
