"""Class-conditional diffusion training of MoH-DiT and DiT on accelerate, DiT's recipe.

DiT (Peebles & Xie, ICCV 2023), which MoH (Jin et al., ICML 2025) keeps for MoH-DiT: AdamW at
a constant 1e-4 without weight decay, an EMA of decay 0.9999 starting as an exact copy, label
dropout 0.1, ADM's centre crop and random flips, 1000 linear diffusion steps with learned-range
variance, loss = MSE(eps) + VB, plus ``lb_coeff`` times MoH's load-balance loss.

:func:`train` reads set up -> resume -> loop -> finish. A run folder holds ``train_config.json``
(the resolved :class:`TrainConfig`), ``checkpoints/step-N`` (:class:`~.checkpoint.Checkpoint`),
``train_log.jsonl``, ``head_usage.jsonl`` and, at the end, ``final/`` (a MoHDiTPipeline folder of
the EMA model). To resume, run again with ``resume="latest"``: a resumed run continues bit for
bit (tested on the CPU with one and two processes). The main process writes; the others wait.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import functools
import importlib.util
import json
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ..models.presets import PRESETS
from ..outputs import atomic_write, output_folder, publish_folder, read_json, write_json
from .checkpoint import Checkpoint, umask_modes

logger = logging.getLogger(__name__)
RUN_RECORD = "train_config.json"
DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
# Dense peak TFLOP/s from the datasheets (bf16/fp16, TF32, fp32) by a fragment of the GPU's name,
# for the MFU in the log; any other device gets a timed matmul.
GPU_PEAK_TFLOPS = {"H200": (989.4, 494.7, 66.9), "H100 PCIe": (756.0, 378.0, 51.2), "H100": (989.4, 494.7, 66.9),
                   "A100": (312.0, 156.0, 19.5), "L40S": (362.05, 183.0, 91.6), "RTX 4090": (165.2, 82.6, 82.6),
                   "A10G": (70.0, 35.0, 31.2), "A10": (125.0, 62.5, 31.2)}


@dataclass
class TrainConfig:
    """Every option of a run (``moh-dit train --help`` says what each does). ``train_config.json``
    holds it with what the launch decided filled in (:meth:`resolved`)."""

    output_dir: str
    preset: str | None = None  # None: the init_from folder's architecture, or the resumed run's
    data_dir: str | None = None  # an image folder, or:
    latents_dir: str | None = None  # a latent cache (its image size and VAE are the run's)
    vae: str | None = None  # None: DEFAULT_VAE (or the cache's); "none": pixel space
    vae_subfolder: str | None = None
    image_size: int | None = None  # None: 256 (or the cache's)
    max_steps: int = 400_000
    global_batch_size: int | None = None  # None: train_batch_size x processes x accumulation, else 256
    train_batch_size: int | None = None  # images per process and forward pass
    gradient_accumulation_steps: int | None = None  # None: accelerate's environment, else 1
    learning_rate: float = 1e-4
    lr_scheduler: str = "constant_with_warmup"
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    max_grad_norm: float | None = None
    checkpoint_every: int = 50_000
    checkpoints_total_limit: int | None = 2  # None or 0: keep all
    resume: str | None = None  # "latest", "checkpoint-N" / "step-N", or a checkpoint folder
    mixed_precision: str | None = None  # None: accelerate's (accelerate launch's option or config)
    allow_tf32: bool = True
    seed: int = 0
    lb_coeff: float = 0.01
    ema_decay: float = 0.9999
    ema_warmup: bool = False  # diffusers' EMAModel warm-up of the decay
    ema_inv_gamma: float = 1.0
    ema_power: float = 2 / 3
    class_dropout: float = 0.1
    gradient_checkpointing: bool = False
    num_workers: int = 4
    on_corrupt: str = "error"  # or "skip" unreadable images
    random_flip: bool = True
    log_every: int = 100
    sample_every: int = 0  # an EMA sample grid every N steps (0: none)
    sample_steps: int = 50
    report_to: str | None = None  # None: tensorboard if installed, else none
    model_overrides: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None  # a saved model folder whose weights a new run starts from
    router_warmup_steps: int = 0
    compile: bool = False
    compile_per_block: bool = False
    compile_mode: str | None = None

    def __post_init__(self):
        if (self.data_dir is None) == (self.latents_dir is None):
            raise ValueError("give exactly one of data_dir (an image folder) and latents_dir (a latent cache)")
        if self.preset is None and self.init_from is None and self.resume is None:
            raise ValueError("preset is required, unless init_from gives a model or resume continues a run")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"preset {self.preset!r} is not one of {', '.join(PRESETS)}")
        for name in ("max_steps", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("ema_decay", "class_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.mixed_precision not in (None, "no", "fp16", "bf16"):
            raise ValueError(f"mixed_precision must be no, fp16 or bf16, got {self.mixed_precision!r}")
        if self.router_warmup_steps and self.preset and PRESETS[self.preset].get("num_shared_heads") is None:
            raise ValueError(f"router_warmup_steps: {self.preset} is a dense DiT without routers")

    @property
    def pixel_space(self) -> bool:
        return self.latents_dir is None and str(self.vae).lower() == "none"

    def resolved(self, num_processes: int = 1, accumulation: int | None = None, mixed_precision: str | None = None,
                 report_to: str | None = None) -> "TrainConfig":
        """This config with a latent cache's image size and VAE, the defaults, and the batch split
        over ``num_processes`` x ``accumulation`` passes filled in: what the run records."""
        image_size, vae, subfolder = self.image_size, self.vae, self.vae_subfolder
        if self.latents_dir is not None:
            from ..data.latents import read_cache_index

            cache = read_cache_index(self.latents_dir)
            if image_size not in (None, cache["image_size"]):
                raise ValueError(f"image_size {image_size} is not the latent cache's ({cache['image_size']} px); "
                                 "leave it out or make a cache of that size")
            image_size, vae, subfolder = cache["image_size"], vae or cache["vae"], subfolder or cache["vae_subfolder"]
        accumulation = accumulation or self.gradient_accumulation_steps or 1
        parts = num_processes * accumulation
        batch = self.global_batch_size or (self.train_batch_size * parts if self.train_batch_size else 256)
        if batch % parts or (self.train_batch_size and batch != self.train_batch_size * parts):
            raise ValueError(f"global_batch_size {batch} does not split into {num_processes} processes x "
                             f"{accumulation} accumulation steps" + (f" x train_batch_size {self.train_batch_size}"
                                                                     if self.train_batch_size else ""))
        return dataclasses.replace(self, image_size=image_size or 256, vae=vae or DEFAULT_VAE,
                                   vae_subfolder=subfolder, global_batch_size=batch, train_batch_size=batch // parts,
                                   gradient_accumulation_steps=accumulation,
                                   mixed_precision=mixed_precision or self.mixed_precision,
                                   report_to=report_to or self.report_to)

    def ema_warning(self) -> str | None:
        """A warning for a run too short for its EMA decay: the EMA would keep >10% of the init."""
        share = 0.0 if self.ema_warmup else self.ema_decay**self.max_steps
        if share > 0.1:
            return (f"ema_decay {self.ema_decay} over {self.max_steps} steps: the EMA model exported as final/ "
                    f"would still be {share:.0%} the initial weights; use ema_warmup or a lower ema_decay")
        return None


def train(cfg: TrainConfig) -> Path:
    """Train ``cfg``'s model and return ``OUT/final``, the exported EMA pipeline. Every process
    of an accelerate launch runs every line; the main process holds the run folder."""
    from accelerate.utils import set_seed

    acc, cfg = _launch(cfg)
    inputs = {"data_dir": cfg.data_dir or cfg.latents_dir, "init_from": cfg.init_from,
              "vae": cfg.vae if Path(cfg.vae).is_dir() else None}
    setup = (RUN_RECORD, "train_log.jsonl", "head_usage.jsonl")
    with (output_folder(cfg.output_dir, "train", resume=cfg.resume is not None, inputs=inputs, setup=setup)
          if acc.is_main_process else nullcontext(Path(cfg.output_dir))) as out:
        acc.wait_for_everyone()  # the folder is the main process's before any process reads it
        # Set up: data, latent space, model, EMA, optimiser (the order of random draws is the run's).
        record = read_json(out / RUN_RECORD) if cfg.resume and (out / RUN_RECORD).is_file() else None
        if record is not None and cfg.init_from is None:  # a run started from weights keeps their origin
            cfg = dataclasses.replace(cfg, init_from=record["init_from"])
        checkpoints = Checkpoint(out)
        start = checkpoints.find(cfg.resume) if cfg.resume else None
        if acc.device.type == "cuda":
            torch.set_float32_matmul_precision("high" if cfg.allow_tf32 else "highest")
        set_seed(cfg.seed, device_specific=True)
        data = _Data(cfg, acc)
        space = _LatentSpace(cfg, data.dataset, acc.device)
        model = _build_model(cfg, space.shape, data.dataset.classes, record, init_weights=start is None)
        parts, model = _build_optimisation(cfg, acc, model, data.sampler)
        flops_per_image = _flops_per_image(parts.ema, space.shape)
        peak = _peak_flops(acc.device, cfg.mixed_precision in ("fp16", "bf16"), cfg.allow_tf32)

        # Resume: the checkpoint's state, then the record of this start and the logs cut to its step.
        if start is not None:
            parts.load(checkpoints.load(start, acc, parts.model, parts.ema, parts.optimizer), cfg)
            if acc.is_main_process:
                logger.info(f"Resumed from {start} at step {parts.step}.")
        if acc.is_main_process:
            write_json(out / RUN_RECORD, {**dataclasses.asdict(cfg), "num_processes": acc.num_processes,
                                          "model_config": _model_config(parts.model)})
            _cut_logs(out, parts.step)
        if cfg.report_to != "none":
            acc.init_trackers("moh-dit", config={k: v for k, v in dataclasses.asdict(cfg).items()
                                                 if isinstance(v, (int, float, str, bool))})

        # Loop: cfg.max_steps optimiser steps of cfg.gradient_accumulation_steps batches each.
        from ..diffusion import create_diffusion

        diffusion, batches = create_diffusion(), data.batches()
        log, watch = _Log(cfg, acc, out, parts, flops_per_image, peak), _FiniteWatch(acc.device)
        while parts.step < cfg.max_steps:
            micro_batches = [space.encode(data.next(batches, parts)) for _ in range(cfg.gradient_accumulation_steps)]
            log_now = (parts.step + 1) % cfg.log_every == 0 or parts.step + 1 == cfg.max_steps
            step = train_step(cfg, acc, parts, model, diffusion, micro_batches, log_now)
            watch.update(parts.step, step["loss"])
            log.add(step)
            sample_now = cfg.sample_every and parts.step % cfg.sample_every == 0
            checkpoint_now = parts.step % cfg.checkpoint_every == 0 or parts.step == cfg.max_steps
            if log_now or sample_now or checkpoint_now:
                watch.check(acc, checkpoints.latest())  # before anything of the step is written
            if log_now:
                log.write(step)
            if sample_now and acc.is_main_process:
                _save_sample_grid(cfg, acc, out, parts, space)
            if checkpoint_now:
                checkpoints.save(parts.step, acc, parts.model, parts.ema, parts.optimizer, parts.state_dict(),
                                 cfg.checkpoints_total_limit)
        log.close()

        # Finish: OUT/final, a pipeline folder of the EMA model.
        if acc.is_main_process:
            _export(out / "final", parts.ema, space.decoder)
            if parts.images_skipped:
                logger.info(f"Skipped {parts.images_skipped} unreadable images.")
        acc.wait_for_everyone()
        acc.end_training()
    return Path(cfg.output_dir) / "final"


# ----- set up ---------------------------------------------------------------------------------

def _launch(cfg: TrainConfig):
    """The Accelerator of this launch and ``cfg`` resolved for it; a tracker asked for but not
    installed is refused first (accelerate would only warn and train untracked)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    if cfg.report_to not in (None, "none") and importlib.util.find_spec(cfg.report_to) is None:
        raise ValueError(f"report_to {cfg.report_to} is not installed: pip install {cfg.report_to}, or report_to none")
    report_to = cfg.report_to or ("tensorboard" if importlib.util.find_spec("tensorboard") else "none")
    acc = Accelerator(mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=cfg.gradient_accumulation_steps
                      or 1, log_with=None if report_to == "none" else report_to,
                      project_config=ProjectConfiguration(cfg.output_dir, logging_dir=f"{cfg.output_dir}/logs"))
    cfg = cfg.resolved(acc.num_processes, acc.gradient_accumulation_steps, acc.mixed_precision, report_to)
    if acc.is_main_process and cfg.ema_warning():
        logger.warning(cfg.ema_warning())
    return acc, cfg

class _Data:
    """The dataset and this process's share of its endless, resumable order."""

    def __init__(self, cfg: TrainConfig, acc):
        from ..data.datasets import ImageFolderDataset, ResumableSampler, collate_skip_corrupt
        from ..data.latents import LatentDataset

        if cfg.latents_dir is not None:
            self.dataset = LatentDataset(cfg.latents_dir, random_flip=cfg.random_flip, seed=cfg.seed)
        else:
            self.dataset = ImageFolderDataset(cfg.data_dir, cfg.image_size, random_flip=cfg.random_flip, seed=cfg.seed,
                                              on_corrupt=cfg.on_corrupt)
        self.per_process = cfg.train_batch_size
        self.sampler = ResumableSampler(len(self.dataset), num_replicas=acc.num_processes, rank=acc.process_index,
                                        seed=cfg.seed)
        # A private generator: a DataLoader iterator would otherwise draw its seed from the global
        # one, and every later random number of a resumed run would shift.
        self.loader_kwargs = dict(batch_size=self.per_process, sampler=self.sampler, num_workers=cfg.num_workers,
                                  generator=torch.Generator(), pin_memory=acc.device.type == "cuda",
                                  collate_fn=collate_skip_corrupt if cfg.on_corrupt == "skip" else None)
        self.device = acc.device

    def batches(self):
        from torch.utils.data import DataLoader

        while True:  # the sampler never ends; the loop stops by step count
            yield from DataLoader(self.dataset, **self.loader_kwargs)

    def next(self, batches, parts: "_Parts") -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(batches)
        self.sampler.advance(self.per_process)
        parts.images_skipped += self.per_process - x.shape[0]  # on_corrupt="skip" dropped them
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


class _LatentSpace:
    """What the model denoises: a latent cache's latents (already scaled), pixels, or the VAE's
    latents encoded on the fly; ``decoder`` is the VAE that final/ and the sample grids decode with."""

    def __init__(self, cfg: TrainConfig, dataset, device: torch.device):
        from ..data.latents import load_vae, vae_downsample_factor

        self.vae = self.decoder = None
        if cfg.latents_dir is not None:
            self.shape = tuple(dataset.latent_shape)
            self.decoder = None if str(cfg.vae).lower() == "none" else load_vae(cfg.vae, cfg.vae_subfolder, device)
        elif cfg.pixel_space:
            self.shape = (3, cfg.image_size, cfg.image_size)
        else:
            self.vae = self.decoder = load_vae(cfg.vae, cfg.vae_subfolder, device)
            factor = vae_downsample_factor(self.vae)
            if cfg.image_size % factor:
                raise ValueError(f"image_size {cfg.image_size} is not a multiple of the VAE's downsampling {factor}")
            self.shape = (self.vae.config.latent_channels, cfg.image_size // factor, cfg.image_size // factor)

    @torch.no_grad()
    def encode(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        if self.vae is not None:  # DiT's vae.encode(x).latent_dist.sample() * 0.18215
            shift = getattr(self.vae.config, "shift_factor", None) or 0.0
            x = (self.vae.encode(x).latent_dist.sample() - shift) * self.vae.config.scaling_factor
        return x, y


def _model_config(model) -> dict:
    return json.loads(json.dumps({k: v for k, v in model.config.items() if not k.startswith("_")}))


def _per_layer(config: dict) -> dict:
    """``config`` with head counts as per-layer lists (4 heads == [4] * layers), without the
    settings a run takes from its data."""
    n = config["num_layers"]
    return {k: [v] * n if k in ("num_attention_heads", "num_shared_heads", "top_k") and isinstance(v, int) else v
            for k, v in config.items() if k not in ("class_names", "class_dropout_prob")}


def _build_model(cfg: TrainConfig, shape: tuple[int, int, int], classes: list[str], record: dict | None,
                 init_weights: bool):
    """The preset's model (else the resumed run's, else the init_from folder's) for this data, with
    the init_from weights when the run starts without a checkpoint."""
    from ..models import MoHDiTTransformer2DModel

    init = None if cfg.init_from is None else Path(cfg.init_from)
    if init is not None and (init / "model_index.json").is_file():
        init = init / "transformer"  # a pipeline folder, such as a run's final/
    if cfg.preset is not None:
        architecture = PRESETS[cfg.preset]
    elif record is not None:
        architecture = record["model_config"]
    elif init is not None:
        architecture = MoHDiTTransformer2DModel.load_config(init)
    else:
        raise ValueError(f"preset is required: {cfg.output_dir} holds no run to resume")
    model = MoHDiTTransformer2DModel.from_config({
        **architecture, **cfg.model_overrides, "sample_size": shape[1], "in_channels": shape[0],
        "num_classes": len(classes), "class_dropout_prob": cfg.class_dropout, "class_names": list(classes)})
    if cfg.router_warmup_steps and not model.is_moh:
        raise ValueError(f"router_warmup_steps: the model of init_from {cfg.init_from} is a dense DiT without routers")
    if record is not None and _model_config(model) != record["model_config"]:
        theirs, ours = record["model_config"], _model_config(model)
        diffs = [f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} now" for k in sorted({*theirs, *ours})
                 if theirs.get(k) != ours.get(k)]
        raise ValueError(f"the model differs from the run's in {cfg.output_dir}: {'; '.join(diffs)}; resume with the "
                         "run's preset, image size and data, or start a new run in another output_dir")
    if init is not None and init_weights:
        source = MoHDiTTransformer2DModel.from_pretrained(init)
        theirs, ours = _per_layer(_model_config(source)), _per_layer(_model_config(model))
        if theirs != ours:
            diffs = [f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in sorted({*theirs, *ours})
                     if theirs.get(k) != ours.get(k)]
            raise ValueError(f"init_from {cfg.init_from} is not the model of preset {cfg.preset} on this data: "
                             f"{'; '.join(diffs)}")
        model.load_state_dict(source.state_dict())
    return model


@dataclass
class _Parts:
    """What a checkpoint saves besides the model, EMA and optimiser: the step, the data position,
    the LR schedule and the loss scale."""

    model: torch.nn.Module  # unwrapped
    ema: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    sampler: Any
    scaler: Any
    step: int = 0
    images_seen: int = 0
    images_skipped: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "images_seen": self.images_seen, "images_skipped": self.images_skipped,
                "sampler": self.sampler.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict(),
                "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def load(self, state: dict, cfg: TrainConfig) -> None:
        self.step, self.images_seen, self.images_skipped = state["step"], state["images_seen"], state["images_skipped"]
        self.sampler.load_state_dict(state["sampler"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        # The optimiser's saved state brought back its learning rate, weight decay and betas: this
        # run's apply from here (the LR schedule's value at this step: the same number when nothing
        # changed, so an exact resume stays exact).
        schedule = self.lr_scheduler
        schedule.base_lrs = [cfg.learning_rate] * len(schedule.base_lrs)
        for group, factor in zip(self.optimizer.param_groups, schedule.lr_lambdas):
            group.update(lr=cfg.learning_rate * factor(schedule.last_epoch), initial_lr=cfg.learning_rate,
                         weight_decay=cfg.weight_decay, betas=tuple(cfg.adam_betas))
        schedule._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def compile_model(model: torch.nn.Module, mode: str | None = None, per_block: bool = False,
                  dynamic: bool | None = False) -> torch.nn.Module:
    """Compile in place (``nn.Module.compile``): the class, attributes and state-dict keys stay
    the model's (no ``_orig_mod.``). ``per_block``: each transformer block instead, which compiles
    one graph for blocks of one shape (much faster to compile); ``dynamic=False``: for the shapes
    seen (training's one batch shape)."""
    for module in model.transformer_blocks if per_block else [model]:
        module.compile(mode=mode, dynamic=dynamic)
    return model


def _build_optimisation(cfg: TrainConfig, acc, model, sampler) -> tuple[_Parts, torch.nn.Module]:
    """EMA (an exact copy), fused AdamW on CUDA, accelerate's preparation and the LR schedule."""
    from diffusers.optimization import get_scheduler

    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    ema = copy.deepcopy(model).to(acc.device).requires_grad_(False).eval()
    model.train()
    if cfg.compile:  # after the EMA copy, in place: the state-dict keys stay the model's
        compile_model(model, cfg.compile_mode, cfg.compile_per_block)
    fused = {"fused": True} if acc.device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  betas=tuple(cfg.adam_betas), **fused)
    model, optimizer = acc.prepare(model, optimizer)
    # Not prepared: accelerate would step it once per process; it steps once per optimiser step.
    lr_scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                                 num_training_steps=cfg.max_steps)
    return _Parts(acc.unwrap_model(model), ema, optimizer, lr_scheduler, sampler, acc.scaler), model


def _flops_per_image(model, shape) -> int:
    """FLOPs of one training step per image: 3 x the forward (the backward costs two), counted
    by torch on one forward of zeros (which draws nothing random), once per architecture."""
    from torch.utils.flop_counter import FlopCounterMode

    key = json.dumps([_model_config(model), shape])
    if key not in _FLOPS:
        device = next(model.parameters()).device
        x, t = torch.zeros(1, *shape, device=device), torch.zeros(1, dtype=torch.long, device=device)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(x, t, t, force_drop_ids=torch.zeros(1, dtype=torch.bool, device=device))
        _FLOPS[key] = 3 * counter.get_total_flops()
    return _FLOPS[key]


_FLOPS: dict[str, int] = {}


@functools.lru_cache
def _peak_flops(device: torch.device, half: bool, tf32: bool) -> float:
    """One device's peak FLOP/s: a known GPU's datasheet figure, else a timed matmul."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAK_TFLOPS.items():
            if key in name:
                return peaks[0 if half else 1 if tf32 else 2] * 1e12
    size, dtype = (1024, torch.float32) if device.type == "cpu" else (8192, torch.bfloat16 if half else torch.float32)
    generator = torch.Generator(device).manual_seed(0)  # not the global stream that training draws from
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    best = math.inf
    for _ in range(3):
        begin = time.perf_counter()
        (a @ a).sum().item()
        best = min(best, time.perf_counter() - begin)
    return 2 * size**3 / best


# ----- the loop -------------------------------------------------------------------------------

def label_drop_mask(labels: torch.Tensor, probability: float) -> torch.Tensor:
    """(B,) bool: the labels that train as the null class (label dropout for guidance), drawn here
    in eager code and handed to the model as ``force_drop_ids``, so a compiled forward draws
    nothing and follows an eager run. The draw is diffusers' ``LabelEmbedding.token_drop``'s,
    at the point of the stream where the model drew it; without dropout nothing is drawn."""
    if probability <= 0:
        return torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    return torch.rand(labels.shape[0], device=labels.device) < probability


def ema_decay_at(step: int, cfg: TrainConfig) -> float:
    """The decay after optimiser step ``step`` (1 for the first): DiT's constant, or with
    ``ema_warmup`` diffusers' EMAModel schedule min(decay, 1 - (1 + (step - 1) / inv_gamma) ** -power)."""
    if not cfg.ema_warmup:
        return cfg.ema_decay
    return min(cfg.ema_decay, 1.0 - (1.0 + max(step - 1, 0) / cfg.ema_inv_gamma) ** -cfg.ema_power)


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * model in two ``_foreach`` kernels over all parameters:
    the arithmetic of ``e.mul_(decay).add_(p, alpha=1 - decay)`` per parameter, bit for bit
    (``_foreach_lerp_`` would round differently)."""
    params = dict(model.named_parameters())
    ema_list = [e for _, e in ema.named_parameters()]
    model_list = [params[name].detach().to(e) for name, e in ema.named_parameters()]
    torch._foreach_mul_(ema_list, decay)
    torch._foreach_add_(ema_list, model_list, alpha=1 - decay)


def train_step(cfg: TrainConfig, accelerator, parts: _Parts, model, diffusion, micro_batches, log_now: bool) -> dict:
    """One optimiser step through ``model`` (as accelerate prepared it): per micro-batch the
    diffusion loss plus ``lb_coeff`` x the load-balance loss, and its backward (accelerate divides
    by their number, so the step equals one of the whole batch); then clipping, AdamW, the LR
    schedule and the EMA. Returns the step's terms as device tensors (nothing waits for them)."""
    sums = torch.zeros(4, device=accelerator.device)  # loss, mse, vb, lb: means over the micro-batches
    for i, (x, y) in enumerate(micro_batches):
        with accelerator.accumulate(model):
            t = diffusion.sample_timesteps(x.shape[0], device=accelerator.device)
            noise = torch.randn_like(x)
            x_t = diffusion.q_sample(x, t, noise)
            drop = label_drop_mask(y, cfg.class_dropout)
            usage = log_now and parts.model.is_moh and i == len(micro_batches) - 1
            with accelerator.autocast():
                out = model(x_t, t, y, output_load_balance_loss=True, output_head_usage=usage, force_drop_ids=drop)
            terms = diffusion.training_losses(out.sample, x, x_t, t, noise)
            loss = terms["loss"].mean() + cfg.lb_coeff * out.load_balance_loss
            accelerator.backward(loss)
        sums += torch.stack([loss.detach(), terms["mse"].mean().detach(), terms["vb"].mean().detach(),
                             out.load_balance_loss.detach()]).float()
    if parts.step < cfg.router_warmup_steps:
        # Router warm-up: the other parameters get no gradient, so AdamW skips them entirely.
        for name, param in model.named_parameters():
            if "router" not in name:
                param.grad = None
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
    parts.optimizer.step()
    parts.lr_scheduler.step()
    parts.optimizer.zero_grad(set_to_none=True)
    update_ema(parts.ema, parts.model, ema_decay_at(parts.step + 1, cfg))
    parts.step += 1
    parts.images_seen += cfg.global_batch_size
    loss, mse, vb, lb = (sums / len(micro_batches)).unbind()
    return {"loss": loss, "mse": mse, "vb": vb, "lb": lb, "grad_norm": grad_norm, "head_usage": out.head_usage}


class _FiniteWatch:
    """The first step whose loss was NaN or infinite, kept on the device: updating it is a few
    tiny kernels and no host sync, so the loop never waits for the GPU; :meth:`check` reads it
    (on every process together) at the steps that log, sample or checkpoint."""

    def __init__(self, device: torch.device):
        self.first = torch.full((1,), -1, dtype=torch.long, device=device)

    def update(self, step: int, loss: torch.Tensor) -> None:
        self.first = torch.where((self.first < 0) & ~torch.isfinite(loss), step, self.first)

    def check(self, acc, last_checkpoint: Path | None) -> None:
        steps = [s for s in (acc.gather(self.first) if acc.num_processes > 1 else self.first).tolist() if s >= 0]
        if steps:
            raise RuntimeError(f"the loss became NaN or infinite at step {min(steps)}; the last checkpoint is "
                               f"{last_checkpoint or 'none'}: lower learning_rate, set max_grad_norm or use bf16, "
                               "then resume")


class _Log:
    """Sums since the last log (device tensors until the log reduces them over the processes),
    written to the trackers, the progress bar, train_log.jsonl and head_usage.jsonl."""

    def __init__(self, cfg: TrainConfig, acc, out: Path, parts: _Parts, flops_per_image: int, peak: float):
        from tqdm.auto import tqdm

        self.cfg, self.acc, self.out, self.parts = cfg, acc, out, parts
        self.flops_per_image, self.peak = flops_per_image, peak
        self.bar = tqdm(total=cfg.max_steps, initial=parts.step, desc="train", dynamic_ncols=True,
                        disable=not acc.is_main_process or not logger.isEnabledFor(logging.INFO))
        self._reset()

    def _reset(self) -> None:
        self.sums = dict.fromkeys(("loss", "mse", "vb", "lb", "grad_norm"), 0.0)
        self.count, self.begin = 0, time.perf_counter()

    def add(self, step: dict) -> None:
        for key in self.sums:
            value = step[key]
            self.sums[key] += value.detach() if torch.is_tensor(value) else value
        self.count += 1
        self.bar.update(1)

    def write(self, step: dict) -> None:
        acc, elapsed = self.acc, time.perf_counter() - self.begin
        logs = {k: float(acc.reduce(torch.as_tensor(v, device=acc.device, dtype=torch.float32), "mean")) / self.count
                for k, v in self.sums.items()}
        images = self.count * self.cfg.global_batch_size
        logs.update(steps_per_sec=self.count / elapsed, images_per_sec=images / elapsed,
                    lr=self.parts.lr_scheduler.get_last_lr()[0], images_skipped=self.parts.images_skipped)
        logs["mfu"] = logs["images_per_sec"] * self.flops_per_image / (self.peak * acc.num_processes)
        if self.cfg.report_to != "none":
            acc.log(logs, step=self.parts.step)
        if acc.is_main_process:
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}", img_s=f"{logs['images_per_sec']:.1f}",
                                 mfu=f"{100 * logs['mfu']:.1f}%")
            with open(self.out / "train_log.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": self.parts.step, **logs}) + "\n")
            if step["head_usage"] is not None:
                usage = [u.tolist() for u in step["head_usage"]]  # per layer, each head's share of the tokens
                with open(self.out / "head_usage.jsonl", "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": self.parts.step, "usage": usage}) + "\n")
        self._reset()

    def close(self) -> None:
        self.bar.close()


def _export(final: Path, ema, vae) -> None:
    """``final``: a MoHDiTPipeline folder of the EMA model, published whole."""
    from .. import MoHDiTPipeline
    from ..diffusion import make_scheduler

    # IDDPM clips predicted images to [-1, 1] in pixel space; DiT does not clip latents.
    pipe = MoHDiTPipeline(transformer=ema, scheduler=make_scheduler("ddpm", clip_sample=vae is None), vae=vae)
    try:
        with publish_folder(final) as tmp:
            pipe.save_pretrained(tmp, safe_serialization=True)
            umask_modes(tmp)
    except (OSError, SafetensorError) as error:  # a full disk: say where, and what is safe
        raise OSError(getattr(error, "errno", None) or errno.EIO, f"{error}; it was not written, the checkpoints "
                      "are intact: free space, then resume", str(final)) from error


def _cut_logs(out: Path, step: int) -> None:
    """Drop the log lines after ``step`` (a run that died after its last checkpoint logged them),
    so a resumed run logs each step once."""
    for name in ("train_log.jsonl", "head_usage.jsonl"):
        if (out / name).is_file():
            lines = (out / name).read_text(encoding="utf-8").splitlines(keepends=True)
            kept = [line for line in lines if line.endswith("\n") and json.loads(line)["step"] <= step]
            if kept != lines:
                with atomic_write(out / name, "w") as f:
                    f.writelines(kept)


@torch.no_grad()
def _save_sample_grid(cfg: TrainConfig, acc, out: Path, parts: _Parts, space: _LatentSpace) -> None:
    """``samples/step-N.png``: the EMA's images of (up to) 16 classes, 4 seeds each, with the
    pipeline final/ will be; also to the trackers that take images."""
    from torchvision.utils import make_grid, save_image

    from .. import MoHDiTPipeline
    from ..diffusion import make_scheduler

    pipe = MoHDiTPipeline(transformer=parts.ema, scheduler=make_scheduler("ddpm", clip_sample=space.decoder is None),
                          vae=space.decoder)
    pipe.set_progress_bar_config(disable=True)
    classes = min(parts.model.config.num_classes, 16)
    images = pipe(class_labels=list(range(classes)) * 4, guidance_scale=1.0, num_inference_steps=cfg.sample_steps,
                  generator=torch.Generator().manual_seed(cfg.seed), output_type="np").images
    grid = make_grid(torch.from_numpy(images).permute(0, 3, 1, 2), nrow=classes)
    with atomic_write(out / "samples" / f"step-{parts.step:07d}.png") as f:
        save_image(grid, f, format="png")
    for tracker in acc.trackers:
        if hasattr(tracker, "log_images"):
            tracker.log_images({"samples": grid[None]}, step=parts.step)
