"""Every training option (:class:`TrainConfig`), the checks that run before any work, and
what a run reports when it stops: its errors and one-line warnings.

Each option that ``moh-dit train`` offers as a flag carries its help text (and, where it
is not ``--field-name``, its spelling) in the field's metadata; the script reads the flags,
their defaults and choices from here, so an option is described in one place.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..models.presets import PRESETS
from ..utils.logging import get_logger
from ..utils.output_folders import check_outside_inputs
from ..utils.resources import check_fits_in_memory
from ..utils.speed import COMPILE_MODES
from .schedules import EMA_INV_GAMMA, EMA_POWER, LR_SCHEDULERS, initial_weight_share
from .tracking import REPORT_TO, check_installed

DIFFUSION_STEPS = 1000
MIXED_PRECISIONS = ("no", "fp16", "bf16")
ON_CORRUPT = ("error", "skip")
DEFAULT_GLOBAL_BATCH_SIZE = 256  # DiT's
# What --data-dir runs use when --image-size / --vae are left out; a --latents-dir run takes
# both from its cache.
DEFAULT_IMAGE_SIZE = 256
DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
# The run's EMA would still be more than this share of the initial weights at the end: warn.
EMA_STALE_SHARE = 0.1
# How accelerate hands an accumulation to the script: accelerate launch sets it from its own
# --gradient_accumulation_steps for DeepSpeed launches only, and its Accelerator prefers it to the
# script's value; a user may set it by hand. A plain launch passes the launcher's flag on nowhere.
ACCUMULATION_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
# --resume by name: diffusers' example scripts' checkpoint-N, or this trainer's folder name step-N.
CHECKPOINT_NAME = re.compile(r"(?:checkpoint|step)-(\d+)")

logger = get_logger(__name__)


class TrainingDivergedError(FloatingPointError):
    """The loss became NaN or infinite."""


class RunFolderBusyError(FileExistsError):
    """Another training run holds the ``--output-dir`` (the message names its pid, host and start)."""


class CheckpointIntegrityError(ValueError):
    """A checkpoint file is missing, truncated, altered or unreadable (the message names it)."""


def warn(message: str) -> None:
    """A one-line warning on stderr (``warning: ...``), shown to Python callers too."""
    logger.warning(message)


def _check(ok: bool, flag: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"{flag} must be {rule}, got {value!r}.")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _zero_is_none(value: int | None) -> int | None:
    return value or None


def option(default: Any = None, help: str | None = None, *, flag: str | None = None, choices=None,
           metavar: str | None = None, one_of: str | None = None, negated: bool = False,
           from_flag: Callable[[Any], Any] | None = None, required: bool = False, aliases: tuple[str, ...] = ()):
    """A field that ``moh-dit train`` offers as a flag. ``flag``: its spelling when not
    ``--field-name``; ``negated``: a boolean whose flag turns it off (``--no-flip``);
    ``one_of``: flags of the same name form a required either-or group; ``from_flag``: maps
    the parsed value onto the field's; ``required``: a flag the command line must give (the
    field defaults to ``default`` and :meth:`TrainConfig.validate` refuses it left unset, so
    that optional fields may follow it in the dataclass); ``aliases``: other names of the flag
    (diffusers' example scripts' spellings), not listed in --help."""
    metadata = {"flag": flag, "help": help, "choices": choices, "metavar": metavar, "one_of": one_of,
                "negated": negated, "from_flag": from_flag, "aliases": aliases, "required": required}
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    """Every training option; those with a flag in ``moh-dit train`` say so in their metadata."""

    preset: str | None = option(None, choices=tuple(PRESETS), metavar="PRESET",
                                help=f"model preset: {', '.join(PRESETS)}. Optional with --init-from (the "
                                "architecture is then the folder's config.json; a preset given must match it) and "
                                "with --resume (the run's recorded model)")
    output_dir: str = option(None, required=True)
    data_dir: str | None = option(None, "ImageFolder: one sub-folder of images per class", one_of="data",
                                  aliases=("--train_data_dir",))
    latents_dir: str | None = option(None, "latent cache written by moh-dit extract-latents", one_of="data")
    vae: str | None = option(None, "AutoencoderKL hub id or local folder, or 'none' for pixel space (default: "
                             f"{DEFAULT_VAE}; with --latents-dir, the cache's VAE)")
    vae_subfolder: str | None = option(None, "subfolder of --vae holding the VAE (e.g. 'vae' of a pipeline)")
    image_size: int | None = option(None, f"image size in pixels (default: {DEFAULT_IMAGE_SIZE}; with --latents-dir, "
                                    "the size the cache was made at)", aliases=("--resolution",))
    max_steps: int = option(400_000, "optimiser steps of the whole run (default: %(default)s)",
                            aliases=("--max_train_steps",))
    global_batch_size: int | None = option(
        None, f"images per optimiser step over all processes (default: {DEFAULT_GLOBAL_BATCH_SIZE}, or "
        "--train-batch-size x processes x --gradient-accumulation-steps)")
    train_batch_size: int | None = option(
        None, "images per process in one forward pass (diffusers' --train_batch_size); the global batch is this x "
        "processes x --gradient-accumulation-steps")
    gradient_accumulation_steps: int | None = option(
        None, "forward/backward passes per optimiser step; the loss is scaled so that the step equals one of the "
        f"whole batch (default: {ACCUMULATION_ENV} when set, else 1; accelerate launch's "
        "--gradient_accumulation_steps is a DeepSpeed option that never reaches this trainer)")
    learning_rate: float = option(1e-4)
    lr_scheduler: str = option("constant_with_warmup", "diffusers.optimization's LR schedule over --max-steps "
                               "(default: %(default)s)", choices=LR_SCHEDULERS)
    weight_decay: float = option(0.0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = option(0, "LR warm-up steps of --lr-scheduler (default: %(default)s)",
                               aliases=("--lr_warmup_steps",))
    max_grad_norm: float | None = option(None, "clip gradients to this norm (default: off, as DiT)")
    checkpoint_every: int = option(50_000, aliases=("--checkpointing_steps",))
    checkpoints_total_limit: int | None = option(
        2, "keep this many newest checkpoints of this run (0: all; default: %(default)s)", from_flag=_zero_is_none)
    resume: str | None = option(None, "'latest' (the newest intact checkpoint of --output-dir; falls back past "
                                "damaged ones), checkpoint-N (its checkpoint of step N, as in diffusers' scripts) or "
                                "a checkpoint folder", aliases=("--resume_from_checkpoint",))
    mixed_precision: str | None = option(
        None, "default: accelerate's choice (accelerate launch --mixed_precision or its config, which set "
        "ACCELERATE_MIXED_PRECISION), else no", choices=MIXED_PRECISIONS)
    allow_tf32: bool = option(True, "disable TF32 matmuls on Ampere+ GPUs", flag="--no-tf32", negated=True)
    seed: int = option(0)
    lb_coeff: float = option(0.01, "weight of the MoH load-balance loss")
    ema_decay: float = option(0.9999, "EMA decay; without --ema-warmup the EMA starts as an exact copy and decays "
                              "at this rate from the first step, as DiT (default: %(default)s)")
    ema_warmup: bool = option(False, "diffusers' EMAModel warm-up: decay min(--ema-decay, 1 - (1 + t / "
                              "--ema-inv-gamma) ** -(--ema-power)) at step t, so short runs get a useful EMA")
    ema_inv_gamma: float = option(EMA_INV_GAMMA, "with --ema-warmup (default: %(default)s)")
    ema_power: float = option(EMA_POWER, "with --ema-warmup: 2/3 suits runs of a million steps, 3/4 shorter ones "
                              "(default: 2/3)")
    class_dropout: float = option(0.1, "label dropout for classifier-free guidance")
    gradient_checkpointing: bool = option(False)
    num_workers: int = option(4, aliases=("--dataloader_num_workers",))
    on_corrupt: str = option("error", "unreadable images: stop with the file name (default) or skip and count them",
                             choices=ON_CORRUPT)
    random_flip: bool = option(True, "disable random horizontal flips", flag="--no-flip", negated=True)
    log_every: int = option(100)
    sample_every: int = option(0, "save an EMA sample grid every N steps (0: off)")
    sample_steps: int = option(50, "DDPM steps of the monitoring grid")
    report_to: str | None = option(None, "experiment tracker (default: tensorboard if it is installed, else none); "
                                   "one that is asked for must be installed", choices=REPORT_TO)
    model_overrides: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = option(None, "start a new run from the weights of a saved model folder "
                                   "(moh-dit upcycle's output; a run's final/ or another pipeline folder: its "
                                   "transformer); new optimiser, EMA starting as a copy of them; not with --resume")
    router_warmup_steps: int = option(0, "MoH presets: train only the router parameters for the first N steps "
                                      "(default: %(default)s)")
    compile: bool = option(False, "torch.compile the transformer (the first steps take longer while it compiles; "
                           "checkpoints are the same as without it, so a run may resume with or without the flag)")
    compile_per_block: bool = option(False, "with --compile: compile each transformer block instead of the whole "
                                     "model (compiles faster)")
    compile_mode: str | None = option(None, "with --compile: torch.compile's mode (default: torch's default)",
                                      choices=COMPILE_MODES)

    def validate(self, num_processes: int | None = None) -> None:
        """Every check that needs no data or model, so bad input fails before any work and
        before anything is written. The batch-size check runs when ``num_processes`` is known
        (or later, through :meth:`check_batch_split`)."""
        if not self.output_dir:
            raise ValueError("--output-dir is required: the folder of the run.")
        if self.preset is None and self.init_from is None and self.resume is None:
            raise ValueError("Give --preset (one of " + ", ".join(PRESETS) + "), or --init-from a saved model folder "
                             "whose config.json gives the architecture, or --resume a run.")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"Unknown preset {self.preset!r}. Known presets: {', '.join(PRESETS)}.")
        if (self.data_dir is None) == (self.latents_dir is None):
            raise ValueError("Give exactly one of --data-dir (an ImageFolder) or --latents-dir (a latent cache).")
        flag, source = data_source(self)
        if not Path(source).exists():
            raise ValueError(f"{flag} {str(source)!r}: the data folder does not exist.")
        if not Path(source).is_dir():
            expected = "an ImageFolder" if self.data_dir is not None else "a latent cache"
            raise ValueError(f"{flag} {str(source)!r} is not a folder (expected {expected}).")
        out = Path(self.output_dir)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--output-dir {str(out)!r} exists and is not a folder; give a folder for the run.")
        if self.vae is not None and self.vae.lower() != "none":
            if Path(self.vae).exists() and not Path(self.vae).is_dir():
                raise ValueError(f"--vae {self.vae!r} is a file; give a VAE folder or hub id, or --vae none for "
                                 "pixel space.")
        if self.vae_subfolder is not None and (self.data_dir is None or self.pixel_space):
            raise ValueError(f"--vae-subfolder {self.vae_subfolder!r} needs a VAE, but the run uses "
                             f"{'--latents-dir' if self.data_dir is None else '--vae none'}; drop --vae-subfolder.")
        # None: decided later (the batch by the launch, the image size by the data)
        optional = ("global_batch_size", "train_batch_size", "gradient_accumulation_steps", "image_size")
        for name in ("max_steps", "checkpoint_every", "image_size", "log_every", *optional):
            value = getattr(self, name)
            if not (value is None and name in optional):
                _check(isinstance(value, int) and value >= 1, f"--{name.replace('_', '-')}", value, "at least 1")
        for name in ("warmup_steps", "num_workers", "sample_every"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 0, f"--{name.replace('_', '-')}", value, "0 or more")
        limit = self.checkpoints_total_limit
        _check(limit is None or (isinstance(limit, int) and limit >= 0), "--checkpoints-total-limit", limit,
               "0 (keep every checkpoint) or more")
        if num_processes is not None:
            self.check_batch_split(num_processes)
        _check(_finite(self.learning_rate) and self.learning_rate > 0, "--learning-rate", self.learning_rate,
               "a finite number above 0")
        _check(_finite(self.weight_decay) and self.weight_decay >= 0, "--weight-decay", self.weight_decay,
               "a finite number, 0 or more")
        _check(self.max_grad_norm is None or (_finite(self.max_grad_norm) and self.max_grad_norm > 0),
               "--max-grad-norm", self.max_grad_norm, "a finite number above 0 (leave it out for no clipping)")
        _check(_finite(self.lb_coeff) and self.lb_coeff >= 0, "--lb-coeff", self.lb_coeff, "a finite number, 0 or more")
        betas = tuple(self.adam_betas)
        _check(len(betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in betas), "adam_betas", self.adam_betas,
               "two numbers in [0, 1)")
        _check(isinstance(self.seed, int) and 0 <= self.seed < 2**31, "--seed", self.seed, f"in [0, {2**31 - 1}]")
        if self.sample_every:
            _check(isinstance(self.sample_steps, int) and 1 <= self.sample_steps <= DIFFUSION_STEPS, "--sample-steps",
                   self.sample_steps, f"in [1, {DIFFUSION_STEPS}] (the diffusion's steps) when --sample-every is on")
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"--mixed-precision must be no, fp16 or bf16, got {self.mixed_precision!r}.")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"--lr-scheduler must be one of {', '.join(LR_SCHEDULERS)}, got {self.lr_scheduler!r}.")
        self._validate_ema()
        _check(_finite(self.class_dropout) and 0.0 <= self.class_dropout < 1.0, "--class-dropout", self.class_dropout,
               "in [0, 1)")
        if self.report_to is not None and self.report_to not in REPORT_TO:
            raise ValueError(f"--report-to must be one of {', '.join(REPORT_TO)}, got {self.report_to!r}.")
        check_installed(self.report_to)
        if self.on_corrupt not in ON_CORRUPT:
            raise ValueError(f"--on-corrupt must be error or skip, got {self.on_corrupt!r}.")
        if self.resume not in (None, "latest") and not Path(self.resume).is_dir() and \
                not CHECKPOINT_NAME.fullmatch(self.resume):
            raise ValueError(f"--resume {self.resume!r} is neither 'latest', checkpoint-N nor an existing checkpoint "
                             "folder.")
        self._validate_init()
        self._validate_compile()
        self._validate_folders()

    @property
    def pixel_space(self) -> bool:
        """Whether the run trains on pixels (``--vae none`` with ``--data-dir``)."""
        return self.data_dir is not None and self.vae is not None and self.vae.lower() == "none"

    def _validate_folders(self) -> None:
        """The run folder never is, lies inside or contains what the run reads: sample grids
        and checkpoints written into --data-dir would become training images of a class."""
        inputs = {"--data-dir": self.data_dir, "--latents-dir": self.latents_dir, "--init-from": self.init_from}
        if self.data_dir is not None and not self.pixel_space and self.vae is not None and Path(self.vae).is_dir():
            inputs["--vae"] = self.vae
        check_outside_inputs(self.output_dir, inputs)

    def resolved(self) -> "TrainConfig":
        """This config with the image size, VAE and accumulation the run really uses, as it
        records them: for --data-dir, the defaults; for --latents-dir, the cache's (from its
        index.json), refusing an --image-size or --vae given that differs from what the cache was
        made with; the accumulation of :meth:`accumulation`. Reads the cache's index, nothing else."""
        if self.data_dir is not None:
            settings = {"image_size": self.image_size or DEFAULT_IMAGE_SIZE, "vae": self.vae or DEFAULT_VAE}
        else:
            settings = cache_settings(self.latents_dir, self.image_size, self.vae)
        return dataclasses.replace(self, **settings, gradient_accumulation_steps=self.accumulation()[0])

    def accumulation(self) -> tuple[int, str]:
        """The run's gradient accumulation and where it comes from. --gradient-accumulation-steps is
        its one source; when the flag is absent, accelerate's ACCELERATE_GRADIENT_ACCUMULATION_STEPS
        (which accelerate's Accelerator would take anyway), else 1. The variable set to another
        value than the flag is refused: one of them would be ignored."""
        flag = self.gradient_accumulation_steps
        env = os.environ.get(ACCUMULATION_ENV, "").strip()
        if not env:
            return (flag, "--gradient-accumulation-steps") if flag else (1, "the default; set it with "
                                                                          "--gradient-accumulation-steps")
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"{ACCUMULATION_ENV}={env!r} (set by accelerate launch for DeepSpeed, or by hand) is not "
                             "a whole number of at least 1; unset it and give --gradient-accumulation-steps.")
        if flag is not None and flag != int(env):
            raise ValueError(f"--gradient-accumulation-steps {flag} disagrees with {ACCUMULATION_ENV}={env} (set by "
                             "accelerate launch for DeepSpeed, or by hand); unset the variable, or give the same value.")
        return int(env), "--gradient-accumulation-steps" if flag else ACCUMULATION_ENV

    def check_batch_split(self, num_processes: int, accumulation: int | None = None) -> int:
        """The global batch of a launch of ``num_processes`` accumulating ``accumulation``
        (default: the option's, else 1) passes per step; it must split evenly into them, and
        agree with --train-batch-size when both are given (``train`` checks this once the
        launch's Accelerator exists, after :meth:`validate`)."""
        accumulation = accumulation or self.gradient_accumulation_steps or 1
        parts = num_processes * accumulation
        split = f"{num_processes} process{'es' if num_processes > 1 else ''} x --gradient-accumulation-steps {accumulation}"
        if self.train_batch_size is not None:
            implied = self.train_batch_size * parts
            if self.global_batch_size is not None and self.global_batch_size != implied:
                raise ValueError(
                    f"--train-batch-size {self.train_batch_size} x {split} makes {implied} images per step, but "
                    f"--global-batch-size is {self.global_batch_size}; give one of the two, or values that agree.")
            return implied
        global_batch = self.global_batch_size or DEFAULT_GLOBAL_BATCH_SIZE
        if global_batch % parts:
            if accumulation == 1:
                raise ValueError(f"--global-batch-size {global_batch} is not divisible by the number of processes "
                                 f"({num_processes}); use a multiple of {num_processes}.")
            raise ValueError(f"--global-batch-size {global_batch} is not divisible by {split} = {parts}; use a "
                             f"multiple of {parts}.")
        return global_batch

    def for_launch(self, num_processes: int, mixed_precision: str, accumulation: int, report_to: str) -> "TrainConfig":
        """This config with what the launch decided filled in -- the global and per-process
        batch, the accumulation (the Accelerator's, built with :meth:`accumulation`'s), the
        precision and the tracker -- as the run records it."""
        if mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"accelerate's mixed precision {mixed_precision!r} is not supported by this trainer; "
                             "use --mixed-precision no, fp16 or bf16.")
        global_batch = self.check_batch_split(num_processes, accumulation)
        return dataclasses.replace(self, global_batch_size=global_batch, gradient_accumulation_steps=accumulation,
                                   train_batch_size=global_batch // (num_processes * accumulation),
                                   mixed_precision=mixed_precision, report_to=report_to)

    def ema_warning(self) -> str | None:
        """The warning for a run whose EMA would end as mostly its initial weights, or None."""
        share = initial_weight_share(self.max_steps, self.ema_decay, self.ema_warmup)
        if share <= EMA_STALE_SHARE:
            return None
        return (f"--ema-decay {self.ema_decay} over {self.max_steps} steps: the EMA model that final/ exports "
                f"would still be {share:.0%} the initial weights (decay ** steps = {share:.3g}); add --ema-warmup, "
                "or lower --ema-decay, for an EMA that follows training.")

    def _validate_ema(self) -> None:
        """--ema-decay, --ema-warmup, --ema-inv-gamma and --ema-power."""
        _check(_finite(self.ema_decay) and 0.0 <= self.ema_decay < 1.0, "--ema-decay", self.ema_decay, "in [0, 1)")
        _check(_finite(self.ema_inv_gamma) and self.ema_inv_gamma > 0, "--ema-inv-gamma", self.ema_inv_gamma,
               "a finite number above 0")
        _check(_finite(self.ema_power) and self.ema_power > 0, "--ema-power", self.ema_power,
               "a finite number above 0")
        if not self.ema_warmup and (self.ema_inv_gamma != EMA_INV_GAMMA or self.ema_power != EMA_POWER):
            raise ValueError("--ema-inv-gamma and --ema-power shape --ema-warmup's schedule; add --ema-warmup or "
                             "drop them.")

    def _validate_compile(self) -> None:
        """--compile, --compile-per-block and --compile-mode."""
        if (self.compile_per_block or self.compile_mode is not None) and not self.compile:
            raise ValueError("--compile-per-block and --compile-mode set how --compile compiles; add --compile "
                             "or drop them.")
        if self.compile_mode is not None and self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"--compile-mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}.")

    def _validate_init(self) -> None:
        """--init-from and --router-warmup-steps."""
        if self.init_from is not None:
            if self.resume is not None:
                raise ValueError("--init-from starts a new run from a model's weights and --resume continues a run "
                                 "from its checkpoint (which holds the weights); give one of them.")
            if not (model_dir(self.init_from) / "config.json").is_file():
                raise ValueError(f"--init-from {self.init_from!r} is not a saved model folder (no config.json); give "
                                 "a folder written by save_pretrained, moh-dit upcycle or a run's final/.")
        steps = self.router_warmup_steps
        _check(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0, "--router-warmup-steps", steps,
               "0 or more")
        if steps and self.preset is not None and PRESETS[self.preset].get("num_shared_heads") is None:
            raise ValueError(f"--router-warmup-steps {steps}: {self.preset} is a dense DiT without routers; use a MoH "
                             "preset or drop the flag.")


def model_dir(folder: str | Path) -> Path:
    """The model folder of a saved model: ``folder`` itself, or the ``transformer/`` of a pipeline
    folder (a training run's ``final/``)."""
    folder = Path(folder)
    return folder / "transformer" if (folder / "model_index.json").is_file() else folder


def _same_vae(given: str, recorded: str) -> bool:
    """Whether --vae ``given`` names the VAE a cache records: the same id, or the same folder."""
    if given == recorded:
        return True
    try:
        return Path(given).is_dir() and Path(recorded).is_dir() and Path(given).samefile(recorded)
    except OSError:
        return False


def cache_settings(latents_dir: str, image_size: int | None, vae: str | None) -> dict[str, Any]:
    """``image_size``, ``vae`` and ``vae_subfolder`` of a run on the latent cache ``latents_dir``:
    the cache's. A flag given that disagrees with the cache is refused, naming both: latents
    of one size and VAE trained as another would be recorded, sampled and exported wrongly."""
    from ..data.latents import read_cache_index

    meta = read_cache_index(latents_dir)
    where = f"--latents-dir {latents_dir}"
    size, made_with = meta.get("image_size"), meta.get("vae") or None
    if vae is not None and vae.lower() == "none":
        raise ValueError(f"--vae none trains on pixels, but {where} holds latents of the VAE "
                         f"{made_with or '(not recorded)'}; leave --vae out: a run on a latent cache takes its VAE.")
    if vae is not None and made_with is not None and not _same_vae(vae, made_with):
        raise ValueError(f"--vae {vae} is not the VAE {where} was made with ({made_with}); leave --vae out (a run on "
                         "a latent cache takes its VAE), or make a cache with that VAE (moh-dit extract-latents).")
    if image_size is not None and size is not None and image_size != size:
        raise ValueError(f"--image-size {image_size} does not match {where}, which was made at {size} px; leave "
                         "--image-size out (a run on a latent cache takes its size), or make a cache at "
                         f"{image_size} px (moh-dit extract-latents --image-size {image_size}).")
    if size is None and image_size is None:
        raise ValueError(f"{where} does not record the image size it was made at (an older cache); pass that size "
                         "with --image-size.")
    return {"image_size": image_size or int(size), "vae": vae or made_with,
            "vae_subfolder": meta.get("vae_subfolder")}


def check_batch_memory(cfg: "TrainConfig", per_process: int) -> None:
    """Refuse a batch whose images alone cannot fit in this machine's memory, before anything
    is written. The estimate is a lower bound: each image of ``per_process`` as float32, twice
    (the loader's items and the batch they are stacked into), and the sampler's entry for it;
    the model's activations come on top."""
    if cfg.latents_dir is not None:
        from ..data.latents import read_cache_index

        shape = read_cache_index(cfg.latents_dir).get("latent_shape") or [4, 1, 1]
    else:
        size = cfg.image_size or DEFAULT_IMAGE_SIZE
        shape = [3, size, size]
    item = 4 * math.prod(int(n) for n in shape)
    given = (f"--global-batch-size {cfg.global_batch_size}" if cfg.global_batch_size is not None
             else f"--train-batch-size {cfg.train_batch_size}" if cfg.train_batch_size is not None
             else f"the default --global-batch-size {DEFAULT_GLOBAL_BATCH_SIZE}")
    check_fits_in_memory(per_process * (2 * item + 128),
                         f"{given} ({per_process} inputs of {'x'.join(map(str, shape))} per process and pass)",
                         "use a smaller --global-batch-size (or --train-batch-size), more "
                         "--gradient-accumulation-steps, or more processes")


def data_source(cfg_or_record: Any) -> tuple[str, str | None]:
    """The data flag and folder of a config or of a run record: ``("--data-dir", path)`` or ``("--latents-dir", path)``."""
    get = cfg_or_record.get if isinstance(cfg_or_record, dict) else lambda k: getattr(cfg_or_record, k)
    return ("--data-dir", get("data_dir")) if get("data_dir") is not None else ("--latents-dir", get("latents_dir"))
