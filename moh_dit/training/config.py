"""Every training option (:class:`TrainConfig`), the checks that run before any work, and
the run's one-line warnings.

Messages name an option by its field (``max_steps``, ``output_dir``) and list it in the
error's ``parameters``; ``moh-dit train``, whose flags carry the fields' names as their
destinations, shows them as its flags.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidInput
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
# What data_dir runs use when image_size / vae are left out; a latents_dir run takes both from its cache.
DEFAULT_IMAGE_SIZE = 256
DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
# The run's EMA would still be more than this share of the initial weights at the end: warn.
EMA_STALE_SHARE = 0.1
# How accelerate hands an accumulation to the script: accelerate launch sets it from its own
# option for DeepSpeed launches only, and its Accelerator prefers it to the script's value; a
# user may set it by hand. A plain launch passes the launcher's option on nowhere.
ACCUMULATION_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
# resume by name: diffusers' example scripts' checkpoint-N, or this trainer's folder name step-N.
CHECKPOINT_NAME = re.compile(r"(?:checkpoint|step)-(\d+)")

logger = get_logger(__name__)


def warn(message: str) -> None:
    """A one-line warning on stderr (``warning: ...``), shown to Python callers too."""
    logger.warning(message)


def _check(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise InvalidInput(f"{name} must be {rule}, got {value!r}.", parameters=name)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class TrainConfig:
    """Every training option (docs/training.md). ``output_dir`` is required (:meth:`validate`
    refuses it unset); ``resume`` is ``"latest"``, ``"checkpoint-N"`` or a checkpoint folder."""

    preset: str | None = None
    output_dir: str = None
    data_dir: str | None = None
    latents_dir: str | None = None
    vae: str | None = None  # None: DEFAULT_VAE, or a latent cache's; "none": pixel space
    vae_subfolder: str | None = None
    image_size: int | None = None
    max_steps: int = 400_000
    global_batch_size: int | None = None  # None: train_batch_size x processes x accumulation, else the default
    train_batch_size: int | None = None  # per process and forward pass
    gradient_accumulation_steps: int | None = None  # None: ACCUMULATION_ENV when set, else 1
    learning_rate: float = 1e-4
    lr_scheduler: str = "constant_with_warmup"
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    max_grad_norm: float | None = None
    checkpoint_every: int = 50_000
    checkpoints_total_limit: int | None = 2  # None or 0: keep all
    resume: str | None = None
    mixed_precision: str | None = None  # None: accelerate's choice
    allow_tf32: bool = True
    seed: int = 0
    lb_coeff: float = 0.01
    ema_decay: float = 0.9999
    ema_warmup: bool = False
    ema_inv_gamma: float = EMA_INV_GAMMA
    ema_power: float = EMA_POWER
    class_dropout: float = 0.1
    gradient_checkpointing: bool = False
    num_workers: int = 4
    on_corrupt: str = "error"
    random_flip: bool = True
    log_every: int = 100
    sample_every: int = 0
    sample_steps: int = 50
    report_to: str | None = None  # None: tensorboard if installed, else none
    model_overrides: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None
    router_warmup_steps: int = 0
    compile: bool = False
    compile_per_block: bool = False
    compile_mode: str | None = None

    def validate(self, num_processes: int | None = None) -> None:
        """Every check that needs no data or model, so bad input fails before any work and
        before anything is written. The batch-size check runs when ``num_processes`` is known
        (or later, through :meth:`check_batch_split`)."""
        if not self.output_dir:
            raise InvalidInput("output_dir is required: the folder of the run.", parameters="output_dir")
        if self.preset is None and self.init_from is None and self.resume is None:
            raise InvalidInput("Give preset (one of " + ", ".join(PRESETS) + "), or init_from a saved model folder "
                               "whose config.json gives the architecture, or resume a run.",
                               parameters=("preset", "init_from", "resume"))
        _check(self.preset is None or self.preset in PRESETS, "preset", self.preset, f"one of {', '.join(PRESETS)}")
        if (self.data_dir is None) == (self.latents_dir is None):
            raise InvalidInput("Give exactly one of data_dir (an ImageFolder) or latents_dir (a latent cache).",
                               parameters=("data_dir", "latents_dir"))
        name, source = data_source(self)
        if not Path(source).exists():
            raise InvalidInput(f"{name} {str(source)!r}: the data folder does not exist.", parameters=name)
        if not Path(source).is_dir():
            expected = "an ImageFolder" if self.data_dir is not None else "a latent cache"
            raise InvalidInput(f"{name} {str(source)!r} is not a folder (expected {expected}).", parameters=name)
        if Path(self.output_dir).exists() and not Path(self.output_dir).is_dir():
            raise InvalidInput(f"output_dir {self.output_dir!r} exists and is not a folder; give a folder for the run.",
                               parameters="output_dir")
        if self.vae is not None and self.vae.lower() != "none" and Path(self.vae).exists() and not Path(self.vae).is_dir():
            raise InvalidInput(f"vae {self.vae!r} is a file; give a VAE folder or hub id, or vae='none' for pixel "
                               "space.", parameters="vae")
        if self.vae_subfolder is not None and (self.data_dir is None or self.pixel_space):
            on, names = (("a latent cache (latents_dir)", ("vae_subfolder", "latents_dir")) if self.data_dir is None
                         else ("pixels", "vae_subfolder"))
            raise InvalidInput(f"vae_subfolder {self.vae_subfolder!r} needs a VAE, but the run trains on {on}; drop "
                               "vae_subfolder.", parameters=names)
        # None: decided later (the batch by the launch, the image size by the data)
        optional = ("global_batch_size", "train_batch_size", "gradient_accumulation_steps", "image_size")
        for name in ("max_steps", "checkpoint_every", "log_every", *optional):
            value = getattr(self, name)
            if not (value is None and name in optional):
                _check(isinstance(value, int) and value >= 1, name, value, "at least 1")
        for name in ("warmup_steps", "num_workers", "sample_every"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 0, name, value, "0 or more")
        steps = self.router_warmup_steps
        _check(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0, "router_warmup_steps", steps,
               "0 or more")
        limit = self.checkpoints_total_limit
        _check(limit is None or (isinstance(limit, int) and limit >= 0), "checkpoints_total_limit", limit,
               "0 (keep every checkpoint) or more")
        if num_processes is not None:
            self.check_batch_split(num_processes)
        for name, low, rule in (("learning_rate", None, "a finite number above 0"),
                                ("weight_decay", 0.0, "a finite number, 0 or more"),
                                ("lb_coeff", 0.0, "a finite number, 0 or more"),
                                ("ema_inv_gamma", None, "a finite number above 0"),
                                ("ema_power", None, "a finite number above 0")):
            value = getattr(self, name)
            _check(_finite(value) and (value >= low if low is not None else value > 0), name, value, rule)
        _check(self.max_grad_norm is None or (_finite(self.max_grad_norm) and self.max_grad_norm > 0),
               "max_grad_norm", self.max_grad_norm, "a finite number above 0 (leave it out for no clipping)")
        for name in ("ema_decay", "class_dropout"):
            value = getattr(self, name)
            _check(_finite(value) and 0.0 <= value < 1.0, name, value, "in [0, 1)")
        betas = tuple(self.adam_betas)
        _check(len(betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in betas), "adam_betas", self.adam_betas,
               "two numbers in [0, 1)")
        _check(isinstance(self.seed, int) and 0 <= self.seed < 2**31, "seed", self.seed, f"in [0, {2**31 - 1}]")
        if self.sample_every:
            _check(isinstance(self.sample_steps, int) and 1 <= self.sample_steps <= DIFFUSION_STEPS, "sample_steps",
                   self.sample_steps, f"in [1, {DIFFUSION_STEPS}] (the diffusion's steps) when sample_every is on")
        for name, choices in (("mixed_precision", MIXED_PRECISIONS), ("lr_scheduler", LR_SCHEDULERS),
                              ("report_to", REPORT_TO), ("on_corrupt", ON_CORRUPT), ("compile_mode", COMPILE_MODES)):
            value = getattr(self, name)
            _check(value in choices or (value is None and name not in ("lr_scheduler", "on_corrupt")), name, value,
                   f"one of {', '.join(choices)}")
        if not self.ema_warmup and (self.ema_inv_gamma != EMA_INV_GAMMA or self.ema_power != EMA_POWER):
            raise InvalidInput("ema_inv_gamma and ema_power shape ema_warmup's schedule; turn on ema_warmup or drop "
                               "them.", parameters=("ema_inv_gamma", "ema_power", "ema_warmup"))
        if (self.compile_per_block or self.compile_mode is not None) and not self.compile:
            raise InvalidInput("compile_per_block and compile_mode set how compile compiles; turn on compile or drop "
                               "them.", parameters=("compile_per_block", "compile_mode", "compile"))
        check_installed(self.report_to)
        if self.resume not in (None, "latest") and not Path(self.resume).is_dir() and \
                not CHECKPOINT_NAME.fullmatch(self.resume):
            raise InvalidInput(f"resume {self.resume!r} is neither 'latest', checkpoint-N nor an existing checkpoint "
                               "folder.", parameters="resume")
        if self.init_from is not None:
            if self.resume is not None:
                raise InvalidInput("init_from starts a new run from a model's weights and resume continues a run "
                                   "from its checkpoint (which holds the weights); give one of them.",
                                   parameters=("init_from", "resume"))
            if not (model_dir(self.init_from) / "config.json").is_file():
                raise InvalidInput(f"init_from {self.init_from!r} is not a saved model folder (no config.json); give "
                                   "a folder written by save_pretrained, moh-dit upcycle or a run's final/.",
                                   parameters="init_from")
        if self.router_warmup_steps and self.preset is not None and PRESETS[self.preset].get("num_shared_heads") is None:
            raise InvalidInput(f"router_warmup_steps {self.router_warmup_steps}: {self.preset} is a dense DiT without "
                               "routers; use a MoH preset or drop router_warmup_steps.",
                               parameters="router_warmup_steps")
        # The run folder never is, lies inside or contains what the run reads: sample grids
        # and checkpoints written into data_dir would become training images of a class.
        inputs = {"data_dir": self.data_dir, "latents_dir": self.latents_dir, "init_from": self.init_from}
        if self.data_dir is not None and not self.pixel_space and self.vae is not None and Path(self.vae).is_dir():
            inputs["vae"] = self.vae
        check_outside_inputs(self.output_dir, inputs, output_flag="output_dir")  # InvalidInput naming both

    @property
    def pixel_space(self) -> bool:
        """Whether the run trains on pixels (``vae="none"`` with ``data_dir``)."""
        return self.data_dir is not None and self.vae is not None and self.vae.lower() == "none"

    def resolved(self) -> "TrainConfig":
        """This config with the image size, VAE and accumulation the run really uses, as it
        records them: for data_dir, the defaults; for latents_dir, the cache's (from its
        index.json), refusing an image_size or vae given that differs from what the cache was
        made with; the accumulation of :meth:`accumulation`. Reads the cache's index, nothing else."""
        if self.data_dir is not None:
            settings = {"image_size": self.image_size or DEFAULT_IMAGE_SIZE, "vae": self.vae or DEFAULT_VAE}
        else:
            settings = cache_settings(self.latents_dir, self.image_size, self.vae)
        return dataclasses.replace(self, **settings, gradient_accumulation_steps=self.accumulation()[0])

    def accumulation(self) -> tuple[int, str]:
        """The run's gradient accumulation and where it comes from. gradient_accumulation_steps is
        its one source; when it is None, accelerate's ACCELERATE_GRADIENT_ACCUMULATION_STEPS
        (which accelerate's Accelerator would take anyway), else 1. The variable set to another
        value than the option is refused: one of them would be ignored."""
        given = self.gradient_accumulation_steps
        env = os.environ.get(ACCUMULATION_ENV, "").strip()
        if not env:
            return (given, "gradient_accumulation_steps") if given else (1, "the default; set it with "
                                                                         "gradient_accumulation_steps")
        if not env.isdigit() or int(env) < 1:
            raise InvalidInput(f"{ACCUMULATION_ENV}={env!r} (set by accelerate launch for DeepSpeed, or by hand) is "
                               "not a whole number of at least 1; unset it and give gradient_accumulation_steps.",
                               parameters="gradient_accumulation_steps")
        if given is not None and given != int(env):
            raise InvalidInput(f"gradient_accumulation_steps {given} disagrees with {ACCUMULATION_ENV}={env} (set by "
                               "accelerate launch for DeepSpeed, or by hand); unset the variable, or give the same "
                               "value.", parameters="gradient_accumulation_steps")
        return int(env), "gradient_accumulation_steps" if given else ACCUMULATION_ENV

    def check_batch_split(self, num_processes: int, accumulation: int | None = None) -> int:
        """The global batch of a launch of ``num_processes`` accumulating ``accumulation``
        (default: the option's, else 1) passes per step; it must split evenly into them, and
        agree with train_batch_size when both are given (``train`` checks this once the
        launch's Accelerator exists, after :meth:`validate`)."""
        accumulation = accumulation or self.gradient_accumulation_steps or 1
        parts = num_processes * accumulation
        split = f"{num_processes} process{'es' if num_processes > 1 else ''} x gradient_accumulation_steps {accumulation}"
        names = ("global_batch_size", "train_batch_size", "gradient_accumulation_steps")
        if self.train_batch_size is not None:
            implied = self.train_batch_size * parts
            if self.global_batch_size is not None and self.global_batch_size != implied:
                raise InvalidInput(
                    f"train_batch_size {self.train_batch_size} x {split} makes {implied} images per step, but "
                    f"global_batch_size is {self.global_batch_size}; give one of the two, or values that agree.",
                    parameters=names)
            return implied
        global_batch = self.global_batch_size or DEFAULT_GLOBAL_BATCH_SIZE
        if global_batch % parts:
            into = (f"the number of processes ({num_processes})" if accumulation == 1 else f"{split} = {parts}")
            raise InvalidInput(f"global_batch_size {global_batch} is not divisible by {into}; use a multiple of "
                               f"{parts}.", parameters=names)
        return global_batch

    def for_launch(self, num_processes: int, mixed_precision: str, accumulation: int, report_to: str) -> "TrainConfig":
        """This config with what the launch decided filled in -- the global and per-process
        batch, the accumulation (the Accelerator's, built with :meth:`accumulation`'s), the
        precision and the tracker -- as the run records it."""
        if mixed_precision not in MIXED_PRECISIONS:
            raise InvalidInput(f"accelerate's mixed precision {mixed_precision!r} is not supported by this trainer; "
                               "set mixed_precision to no, fp16 or bf16.", parameters="mixed_precision")
        global_batch = self.check_batch_split(num_processes, accumulation)
        return dataclasses.replace(self, global_batch_size=global_batch, gradient_accumulation_steps=accumulation,
                                   train_batch_size=global_batch // (num_processes * accumulation),
                                   mixed_precision=mixed_precision, report_to=report_to)

    def ema_warning(self) -> str | None:
        """The warning for a run whose EMA would end as mostly its initial weights, or None."""
        share = initial_weight_share(self.max_steps, self.ema_decay, self.ema_warmup)
        if share <= EMA_STALE_SHARE:
            return None
        return (f"ema_decay {self.ema_decay} over {self.max_steps} steps: the EMA model that final/ exports "
                f"would still be {share:.0%} the initial weights (decay ** steps = {share:.3g}); turn on ema_warmup, "
                "or lower ema_decay, for an EMA that follows training.")


def model_dir(folder: str | Path) -> Path:
    """The model folder of a saved model: ``folder`` itself, or the ``transformer/`` of a pipeline
    folder (a training run's ``final/``)."""
    folder = Path(folder)
    return folder / "transformer" if (folder / "model_index.json").is_file() else folder


def _same_vae(given: str, recorded: str) -> bool:
    """Whether the vae ``given`` names the VAE a cache records: the same id, or the same folder."""
    if given == recorded:
        return True
    try:
        return Path(given).is_dir() and Path(recorded).is_dir() and Path(given).samefile(recorded)
    except OSError:
        return False


def cache_settings(latents_dir: str, image_size: int | None, vae: str | None) -> dict[str, Any]:
    """``image_size``, ``vae`` and ``vae_subfolder`` of a run on the latent cache ``latents_dir``:
    the cache's. A value given that disagrees with the cache is refused, naming both: latents
    of one size and VAE trained as another would be recorded, sampled and exported wrongly."""
    from ..data.latents import read_cache_index

    meta = read_cache_index(latents_dir)
    where = f"latents_dir {latents_dir}"
    size, made_with = meta.get("image_size"), meta.get("vae") or None
    if vae is not None and vae.lower() == "none":
        raise InvalidInput(f"vae='none' trains on pixels, but {where} holds latents of the VAE "
                           f"{made_with or '(not recorded)'}; leave vae out: a run on a latent cache takes its VAE.",
                           parameters=("vae", "latents_dir"))
    if vae is not None and made_with is not None and not _same_vae(vae, made_with):
        raise InvalidInput(f"vae {vae} is not the VAE {where} was made with ({made_with}); leave vae out (a run on "
                           "a latent cache takes its VAE), or make a cache with that VAE (moh-dit extract-latents).",
                           parameters=("vae", "latents_dir"))
    if image_size is not None and size is not None and image_size != size:
        raise InvalidInput(f"image_size {image_size} does not match {where}, which was made at {size} px; leave "
                           "image_size out (a run on a latent cache takes its size), or make a cache at "
                           f"{image_size} px (moh-dit extract-latents).", parameters=("image_size", "latents_dir"))
    if size is None and image_size is None:
        raise InvalidInput(f"{where} does not record the image size it was made at (an older cache); give that "
                           "size as image_size.", parameters=("latents_dir", "image_size"))
    return {"image_size": image_size or int(size), "vae": vae or made_with,
            "vae_subfolder": meta.get("vae_subfolder")}


def check_batch_memory(cfg: "TrainConfig", per_process: int) -> None:
    """Refuse a batch that cannot fit in this machine's memory, before anything is written (once
    per command: the run's start, or its dry run). Counted: each input of ``per_process`` as
    float32, twice (the loader's items and the batch they are stacked into), and the sampler's
    entry for it; and, for a run on the CPU whose preset is known, the training step itself
    (activations, weights, gradients, optimiser and EMA: ``training_step_bytes``). On a GPU the
    step's memory is the device's, which reports its own shortage."""
    import torch

    from ..models.config_checks import training_step_bytes
    from ..models.presets import get_preset

    if cfg.latents_dir is not None:
        from ..data.latents import read_cache_index

        shape = read_cache_index(cfg.latents_dir).get("latent_shape") or [4, 1, 1]
        model_input = shape
    else:
        size = cfg.image_size or DEFAULT_IMAGE_SIZE
        shape = [3, size, size]
        model_input = shape if cfg.pixel_space else [4, size // 8, size // 8]  # the SD VAE's latents
    item = 4 * math.prod(int(n) for n in shape)
    needed = per_process * (2 * item + 128)
    if cfg.preset is not None and not torch.cuda.is_available():
        model = {**get_preset(cfg.preset), **cfg.model_overrides, "in_channels": model_input[0],
                 "sample_size": model_input[1]}
        needed += training_step_bytes(model, per_process)
    given = (f"global_batch_size {cfg.global_batch_size}" if cfg.global_batch_size is not None
             else f"train_batch_size {cfg.train_batch_size}" if cfg.train_batch_size is not None
             else f"the default global_batch_size {DEFAULT_GLOBAL_BATCH_SIZE}")
    check_fits_in_memory(needed, f"{given} ({per_process} inputs of {'x'.join(map(str, shape))} per process and pass"
                         f"{', with ' + cfg.preset + ' training on them' if cfg.preset else ''})",
                         "use a smaller global_batch_size (or train_batch_size), more gradient_accumulation_steps, or "
                         "more processes", parameters=("global_batch_size", "train_batch_size",
                                                       "gradient_accumulation_steps"))


def data_source(cfg_or_record: Any) -> tuple[str, str | None]:
    """The data option and folder of a config or of a run record: ``("data_dir", path)`` or ``("latents_dir", path)``."""
    get = cfg_or_record.get if isinstance(cfg_or_record, dict) else lambda k: getattr(cfg_or_record, k)
    return ("data_dir", get("data_dir")) if get("data_dir") is not None else ("latents_dir", get("latents_dir"))
