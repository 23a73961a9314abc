"""Every training option (:class:`TrainConfig`) and the checks that run before any work."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models.presets import PRESETS
from ..utils.speed import COMPILE_MODES

DIFFUSION_STEPS = 1000


def _check(ok: bool, flag: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"{flag} must be {rule}, got {value!r}.")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class TrainConfig:
    """Every training option; ``scripts/train.py`` maps its flags onto these fields."""

    preset: str
    output_dir: str
    data_dir: str | None = None
    latents_dir: str | None = None
    vae: str = "stabilityai/sd-vae-ft-ema"
    vae_subfolder: str | None = None
    image_size: int = 256
    max_steps: int = 400_000
    global_batch_size: int = 256
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    max_grad_norm: float | None = None
    checkpoint_every: int = 50_000
    checkpoints_total_limit: int | None = 2
    resume: str | None = None
    mixed_precision: str = "no"
    allow_tf32: bool = True
    seed: int = 0
    lb_coeff: float = 0.01
    ema_decay: float = 0.9999
    class_dropout: float = 0.1
    gradient_checkpointing: bool = False
    num_workers: int = 4
    on_corrupt: str = "error"
    random_flip: bool = True
    log_every: int = 100
    sample_every: int = 0
    sample_steps: int = 50
    report_to: str = "tensorboard"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None  # a saved model folder: a new run starts from its weights
    router_warmup_steps: int = 0  # only router parameters train for the first N steps
    compile: bool = False  # torch.compile the transformer (in place: checkpoints keep its keys)
    compile_per_block: bool = False  # compile each block instead of the whole forward (shorter compile)
    compile_mode: str | None = None  # torch.compile's mode (moh_dit.utils.speed.COMPILE_MODES); None: its default

    def validate(self, num_processes: int | None = None) -> None:
        """Every check that needs no data or model, so bad input fails before any work and
        before anything is written. The batch-size check runs when ``num_processes`` is known."""
        if self.preset not in PRESETS:
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
        if self.data_dir is not None and self.vae.lower() != "none":
            if Path(self.vae).exists() and not Path(self.vae).is_dir():
                raise ValueError(f"--vae {self.vae!r} is a file; give a VAE folder or hub id, or --vae none for "
                                 "pixel space.")
        if self.vae_subfolder is not None and (self.data_dir is None or self.vae.lower() == "none"):
            raise ValueError(f"--vae-subfolder {self.vae_subfolder!r} needs a VAE, but the run uses "
                             f"{'--latents-dir' if self.data_dir is None else '--vae none'}; drop --vae-subfolder.")
        for name in ("max_steps", "global_batch_size", "checkpoint_every", "image_size", "log_every"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, f"--{name.replace('_', '-')}", value, "at least 1")
        for name in ("warmup_steps", "num_workers", "sample_every"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 0, f"--{name.replace('_', '-')}", value, "0 or more")
        limit = self.checkpoints_total_limit
        _check(limit is None or (isinstance(limit, int) and limit >= 0), "--checkpoints-total-limit", limit,
               "0 (keep every checkpoint) or more")
        if num_processes is not None and self.global_batch_size % num_processes:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by the number of processes "
                f"({num_processes}); use a multiple of {num_processes}."
            )
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
        if self.mixed_precision not in ("no", "fp16", "bf16"):
            raise ValueError(f"--mixed-precision must be no, fp16 or bf16, got {self.mixed_precision!r}.")
        _check(_finite(self.ema_decay) and 0.0 <= self.ema_decay < 1.0, "--ema-decay", self.ema_decay, "in [0, 1)")
        _check(_finite(self.class_dropout) and 0.0 <= self.class_dropout < 1.0, "--class-dropout", self.class_dropout,
               "in [0, 1)")
        if self.report_to not in ("tensorboard", "wandb", "none"):
            raise ValueError(f"--report-to must be tensorboard, wandb or none, got {self.report_to!r}.")
        if self.on_corrupt not in ("error", "skip"):
            raise ValueError(f"--on-corrupt must be error or skip, got {self.on_corrupt!r}.")
        if self.resume not in (None, "latest") and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume!r} is neither 'latest' nor an existing checkpoint folder.")
        self._validate_init()
        self._validate_compile()

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
            if not (Path(self.init_from) / "config.json").is_file():
                raise ValueError(f"--init-from {self.init_from!r} is not a saved model folder (no config.json); give "
                                 "a folder written by save_pretrained, scripts/upcycle.py or a run's final/.")
        steps = self.router_warmup_steps
        _check(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0, "--router-warmup-steps", steps,
               "0 or more")
        if steps and PRESETS[self.preset].get("num_shared_heads") is None:
            raise ValueError(f"--router-warmup-steps {steps}: {self.preset} is a dense DiT without routers; use a MoH "
                             "preset or drop the flag.")


def data_source(cfg_or_record: Any) -> tuple[str, str | None]:
    """The data flag and folder of a config or of a run record: ``("--data-dir", path)`` or ``("--latents-dir", path)``."""
    get = cfg_or_record.get if isinstance(cfg_or_record, dict) else lambda k: getattr(cfg_or_record, k)
    return ("--data-dir", get("data_dir")) if get("data_dir") is not None else ("--latents-dir", get("latents_dir"))
