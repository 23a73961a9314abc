"""Class-conditional latent (or pixel) diffusion training of MoH-DiT / DiT on accelerate.

The recipe is the paper's (MOH_DIT_FACTS.md section 5): AdamW at a constant 1e-4 without
weight decay, EMA 0.9999 starting as an exact copy, class dropout 0.1, ADM centre crop and
horizontal flips, 1000-step linear diffusion with learned-range variance, loss = MSE(eps)
+ VB, plus ``lb_coeff`` times the model's load-balance loss.

To resume, run the same command again with ``--resume latest``: checkpoints hold the
model, EMA, optimiser, LR schedule, step, data position and every process's RNG states,
so a resumed run continues bit for bit (tested on CPU). Checkpoints are written into a
temporary folder that is renamed into place only when complete.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from .convert import save_pretrained_atomic
from .data import ImageFolderDataset, ResumableSampler, collate_skip_corrupt
from .io_utils import write_json_atomic
from .diffusion import create_diffusion
from .latents import LatentDataset, load_vae, vae_downsample_factor
from .presets import PRESETS
from .transformer_moh_dit import MoHDiTTransformer2DModel

__all__ = ["TrainConfig", "train", "find_latest_checkpoint", "TrainingDivergedError"]

CHECKPOINT_PREFIX = "step-"
COMPLETE_MARKER = "checkpoint.json"


class TrainingDivergedError(FloatingPointError):
    """The loss became NaN or infinite."""


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

    def validate(self, num_processes: int | None = None) -> None:
        """Every check that needs no data or model, so bad input fails before any work.
        The batch-size check runs when ``num_processes`` is known."""
        if self.preset not in PRESETS:
            raise ValueError(f"Unknown preset {self.preset!r}. Known presets: {', '.join(PRESETS)}.")
        if (self.data_dir is None) == (self.latents_dir is None):
            raise ValueError("Give exactly one of --data-dir (an ImageFolder) or --latents-dir (a latent cache).")
        source = self.data_dir or self.latents_dir
        if not Path(source).is_dir():
            raise ValueError(f"Data folder {source!r} does not exist or is not a folder.")
        for name in ("max_steps", "global_batch_size", "checkpoint_every", "image_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}.")
        if num_processes is not None and self.global_batch_size % num_processes:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by the number of processes "
                f"({num_processes}); use a multiple of {num_processes}."
            )
        if self.mixed_precision not in ("no", "fp16", "bf16"):
            raise ValueError(f"--mixed-precision must be no, fp16 or bf16, got {self.mixed_precision!r}.")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"--ema-decay must be in [0, 1), got {self.ema_decay}.")
        if not 0.0 <= self.class_dropout < 1.0:
            raise ValueError(f"--class-dropout must be in [0, 1), got {self.class_dropout}.")
        if self.report_to not in ("tensorboard", "wandb", "none"):
            raise ValueError(f"--report-to must be tensorboard, wandb or none, got {self.report_to!r}.")
        if self.on_corrupt not in ("error", "skip"):
            raise ValueError(f"--on-corrupt must be error or skip, got {self.on_corrupt!r}.")
        if self.resume not in (None, "latest") and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume!r} is neither 'latest' nor an existing checkpoint folder.")


# --------------------------------------------------------------------------------------
# Checkpoint folders
# --------------------------------------------------------------------------------------


def _complete_checkpoints(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every finished checkpoint, oldest first. Temporary folders of an
    interrupted save start with '.' and have no marker, so they are never picked."""
    found = []
    if checkpoint_dir.is_dir():
        for path in checkpoint_dir.iterdir():
            match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
            if match and (path / COMPLETE_MARKER).is_file():
                found.append((int(match.group(1)), path))
    return sorted(found)


def find_latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``output_dir/checkpoints``, or None."""
    found = _complete_checkpoints(Path(output_dir) / "checkpoints")
    return found[-1][1] if found else None


class _TrainState:
    """Step counter and data position, saved with accelerate's checkpoint."""

    def __init__(self, sampler: ResumableSampler):
        self.step = 0
        self.images_seen = 0
        self.images_skipped = 0
        self.sampler = sampler

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "images_seen": self.images_seen, "images_skipped": self.images_skipped,
                "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.images_seen = int(state["images_seen"])
        self.images_skipped = int(state.get("images_skipped", 0))
        self.sampler.load_state_dict(state["sampler"])


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * model, parameter by parameter (DiT's constant decay)."""
    ema_params = dict(ema.named_parameters())
    for name, param in model.named_parameters():
        ema_params[name].mul_(decay).add_(param.detach().to(ema_params[name].dtype), alpha=1 - decay)


# --------------------------------------------------------------------------------------
# Sampling a grid while training
# --------------------------------------------------------------------------------------


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
        x = vae.decode(x / vae.config.scaling_factor).sample
    return ((x.clamp(-1, 1) + 1) / 2).float().cpu()


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


def _build_data(cfg: TrainConfig, num_processes: int, rank: int):
    if cfg.latents_dir is not None:
        dataset = LatentDataset(cfg.latents_dir, random_flip=cfg.random_flip, seed=cfg.seed)
        return dataset, dataset.classes, dataset.class_to_idx
    dataset = ImageFolderDataset(
        cfg.data_dir, cfg.image_size, random_flip=cfg.random_flip, seed=cfg.seed, on_corrupt=cfg.on_corrupt
    )
    return dataset, dataset.classes, dataset.class_to_idx


def _infinite_batches(loader):
    while True:
        yield from loader


def _save_checkpoint(accelerator, cfg: TrainConfig, step: int) -> Path:
    """accelerate.save_state into '.step-N.tmp', marker last, then an atomic rename."""
    ckpt_dir = Path(cfg.output_dir) / "checkpoints"
    final = ckpt_dir / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = ckpt_dir / f".{final.name}.tmp"
    if accelerator.is_main_process:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=False)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json_atomic(tmp / COMPLETE_MARKER, {"step": step, "preset": cfg.preset})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if cfg.checkpoints_total_limit:
            for _, old in _complete_checkpoints(ckpt_dir)[: -cfg.checkpoints_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _set_tf32(enabled: bool) -> None:
    # torch >= 2.9 has per-backend fp32_precision switches, and mixing them with the old
    # allow_tf32 flags raises; use the new ones where they exist.
    mode = "tf32" if enabled else "ieee"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
    else:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def train(cfg: TrainConfig) -> Path:
    """Train ``cfg.preset`` and return the folder of the exported EMA model (``OUT/final``)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    cfg.validate()
    log_with = None if cfg.report_to == "none" else cfg.report_to
    accelerator = Accelerator(
        mixed_precision=cfg.mixed_precision,
        log_with=log_with,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / "logs")),
    )
    cfg.validate(accelerator.num_processes)
    device = accelerator.device
    out_dir = Path(cfg.output_dir)
    if device.type == "cuda":
        _set_tf32(cfg.allow_tf32)
    set_seed(cfg.seed, device_specific=True)

    # ---- data (validated before any model or VAE work)
    dataset, classes, class_to_idx = _build_data(cfg, accelerator.num_processes, accelerator.process_index)
    per_process = cfg.global_batch_size // accelerator.num_processes
    sampler = ResumableSampler(len(dataset), num_replicas=accelerator.num_processes,
                               rank=accelerator.process_index, seed=cfg.seed)
    collate = collate_skip_corrupt if cfg.on_corrupt == "skip" else None
    # A private generator: DataLoader iterators draw a seed from the global RNG otherwise,
    # which would shift every later random number after a resume.
    loader_kwargs = dict(batch_size=per_process, sampler=sampler, num_workers=cfg.num_workers, drop_last=False,
                         generator=torch.Generator(), pin_memory=device.type == "cuda",
                         persistent_workers=False)
    if collate is not None:
        loader_kwargs["collate_fn"] = collate

    # ---- VAE and model
    vae = None
    if cfg.latents_dir is not None:
        latent_shape = tuple(dataset.latent_shape)
        scaling = dataset.scaling_factor
    elif cfg.vae.lower() == "none":
        latent_shape = (3, cfg.image_size, cfg.image_size)
        scaling = None
    else:
        vae = load_vae(cfg.vae, cfg.vae_subfolder, device=device)
        factor = vae_downsample_factor(vae)
        if cfg.image_size % factor:
            raise ValueError(f"--image-size {cfg.image_size} is not divisible by the VAE's downsampling factor {factor}.")
        latent_shape = (vae.config.latent_channels, cfg.image_size // factor, cfg.image_size // factor)
        scaling = vae.config.scaling_factor
    overrides = dict(cfg.model_overrides)
    overrides.update(sample_size=latent_shape[1], in_channels=latent_shape[0], num_classes=len(classes),
                     class_dropout_prob=cfg.class_dropout, class_names=list(classes))
    model = MoHDiTTransformer2DModel.from_preset(cfg.preset, **overrides)
    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    ema = copy.deepcopy(model).to(device).requires_grad_(False).eval()
    model.train()
    diffusion = create_diffusion()

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  betas=tuple(cfg.adam_betas))
    warmup = max(cfg.warmup_steps, 0)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    unwrapped = accelerator.unwrap_model(model)
    state = _TrainState(sampler)
    accelerator.register_for_checkpointing(ema, state)

    # ---- run folder: resolved options and class map, written before training
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / "train_config.json", {
            **dataclasses.asdict(cfg), "num_processes": accelerator.num_processes, "per_process_batch_size": per_process,
            "latent_shape": list(latent_shape),
            "model_config": {k: v for k, v in dict(unwrapped.config).items() if not k.startswith("_")},
        })
        write_json_atomic(out_dir / "class_index.json", class_to_idx)

    resume_from = None
    if cfg.resume == "latest":
        resume_from = find_latest_checkpoint(out_dir)
        if resume_from is None:
            accelerator.print(f"--resume latest: no checkpoint in {out_dir / 'checkpoints'} yet, starting from scratch.")
    elif cfg.resume:
        resume_from = Path(cfg.resume)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        accelerator.print(f"Resumed from {resume_from} at step {state.step}.")

    if log_with is not None:
        accelerator.init_trackers("moh-dit", config={k: v for k, v in dataclasses.asdict(cfg).items()
                                                     if isinstance(v, (int, float, str, bool))})

    loader = DataLoader(dataset, **loader_kwargs)
    batches = _infinite_batches(loader)
    is_moh = unwrapped.is_moh
    sums = {"loss": 0.0, "mse": 0.0, "vb": 0.0, "lb": 0.0, "grad_norm": 0.0}
    count, window_start, window_images = 0, time.perf_counter(), 0
    progress = None
    if accelerator.is_main_process:
        from tqdm.auto import tqdm

        progress = tqdm(total=cfg.max_steps, initial=state.step, desc="train", dynamic_ncols=True)

    last_ckpt = find_latest_checkpoint(out_dir)
    while state.step < cfg.max_steps:
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sampler.advance(per_process)
        state.images_skipped += per_process - x.shape[0]  # unreadable images dropped (--on-corrupt skip)
        if vae is not None:
            with torch.no_grad():
                shift = getattr(vae.config, "shift_factor", None) or 0.0
                x = (vae.encode(x).latent_dist.sample() - shift) * scaling
        log_now = (state.step + 1) % cfg.log_every == 0 or state.step + 1 == cfg.max_steps
        t = diffusion.sample_timesteps(x.shape[0], device=device)
        noise = torch.randn_like(x)
        x_t = diffusion.q_sample(x, t, noise)
        with accelerator.autocast():
            out = model(x_t, t, y, output_load_balance_loss=True, output_head_usage=log_now and is_moh)
        terms = diffusion.training_losses(out.sample, x, x_t, t, noise)
        loss = terms["loss"].mean() + cfg.lb_coeff * out.load_balance_loss
        if not torch.isfinite(loss):
            raise TrainingDivergedError(
                f"The loss became {loss.item()} at step {state.step + 1} (mse {terms['mse'].mean().item():.4g}, "
                f"vb {terms['vb'].mean().item():.4g}, lb {out.load_balance_loss.item():.4g}). "
                f"The last good checkpoint is {last_ckpt or 'none'}; lower --learning-rate, set --max-grad-norm, "
                "or use bf16 instead of fp16, then resume."
            )
        accelerator.backward(loss)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        update_ema(ema, unwrapped, cfg.ema_decay)
        state.step += 1
        state.images_seen += cfg.global_batch_size
        window_images += cfg.global_batch_size

        sums["loss"] += loss.detach()
        sums["mse"] += terms["mse"].mean().detach()
        sums["vb"] += terms["vb"].mean().detach()
        sums["lb"] += out.load_balance_loss.detach()
        sums["grad_norm"] += grad_norm.detach() if torch.is_tensor(grad_norm) else grad_norm
        count += 1
        if progress is not None:
            progress.update(1)

        if log_now:
            elapsed = time.perf_counter() - window_start
            logs = {k: float(accelerator.reduce(torch.as_tensor(v, device=device, dtype=torch.float32), "mean")) / count
                    for k, v in sums.items()}
            logs.update(steps_per_sec=count / elapsed, images_per_sec=window_images / elapsed,
                        lr=lr_scheduler.get_last_lr()[0], images_skipped=state.images_skipped)
            if is_moh and out.head_usage is not None:
                for i, usage in enumerate(out.head_usage):
                    routed = usage[unwrapped.layer_shared[i]:]
                    if routed.numel() > 1:
                        # coefficient of variation of routed-head usage: 0 = perfectly balanced
                        logs[f"head_balance_cv/layer_{i:02d}"] = (routed.std() / routed.mean().clamp_min(1e-8)).item()
                if accelerator.is_main_process:
                    with open(out_dir / "head_usage.jsonl", "a") as f:
                        f.write(json.dumps({"step": state.step, "usage": [u.tolist() for u in out.head_usage]}) + "\n")
            if log_with is not None:
                accelerator.log(logs, step=state.step)
            if progress is not None:
                progress.set_postfix(loss=f"{logs['loss']:.4f}", mse=f"{logs['mse']:.4f}", lb=f"{logs['lb']:.3f}",
                                     it_s=f"{logs['steps_per_sec']:.2f}")
                with open(out_dir / "train_log.jsonl", "a") as f:
                    f.write(json.dumps({"step": state.step, **logs}) + "\n")
            sums = {k: 0.0 for k in sums}
            count, window_start, window_images = 0, time.perf_counter(), 0

        if cfg.sample_every and state.step % cfg.sample_every == 0 and accelerator.is_main_process:
            _save_sample_grid(ema, diffusion, len(classes), latent_shape, vae, cfg, state.step, device)

        if state.step % cfg.checkpoint_every == 0 or state.step == cfg.max_steps:
            last_ckpt = _save_checkpoint(accelerator, cfg, state.step)

    if progress is not None:
        progress.close()
    if state.images_skipped:
        accelerator.print(f"Skipped {state.images_skipped} unreadable images (--on-corrupt skip).")
    final = out_dir / "final"
    if accelerator.is_main_process:
        save_pretrained_atomic(ema, final, overwrite=True)
        write_json_atomic(final / "class_index.json", class_to_idx)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final


def _save_sample_grid(ema, diffusion, num_classes, latent_shape, vae, cfg: TrainConfig, step: int, device) -> None:
    from torchvision.utils import save_image

    images = sample_grid(ema, diffusion, num_classes, latent_shape, vae, steps=cfg.sample_steps, per_class=4,
                         seed=cfg.seed, device=device)
    folder = Path(cfg.output_dir) / "samples"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".step-{step:07d}.tmp.png"
    save_image(images, tmp, nrow=min(num_classes, 16))
    os.replace(tmp, folder / f"step-{step:07d}.png")

