"""``train``: the run as a sequence of named steps.

Check the options and the launch, plan the run folder (busy? whose run? where to resume
from?), build the data, the latent space and the model, claim the folder, build the EMA,
optimiser and schedule, resume, record the run, loop, export ``OUT/final``. Everything that
can refuse the run happens before anything is written.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..data.datasets import ImageFolderDataset, ResumableSampler, collate_skip_corrupt, write_class_index
from ..diffusion.gaussian_diffusion import create_diffusion
from ..utils.io import publish_folder
from ..data.latents import LatentDataset, load_vae, vae_downsample_factor
from ..models.presets import resolve_layer_layout
from ..utils.runtime import set_tf32
from ..utils.speed import compile_model, peak_flops, training_flops_per_image
from ..models.transformer_moh_dit import MoHDiTTransformer2DModel
from .checkpoints import Parts, TrainState, load_checkpoint
from .config import TrainConfig
from .errors import warn
from .loop import LatentSpace, LoopContext, run_loop
from .processes import on_main
from .run_folder import (FolderLock, Plan, claim_folder, normalized, probe_and_plan, record_run,
                         run_identity)


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


def train(cfg: TrainConfig) -> Path:
    """Train ``cfg.preset`` and return the folder of the exported EMA model (``OUT/final``)."""
    cfg.validate()
    accelerator, log_with = _start_accelerator(cfg)
    lock = FolderLock(Path(cfg.output_dir))
    try:
        return _train(cfg, accelerator, lock, log_with)
    finally:
        lock.release()


def _start_accelerator(cfg: TrainConfig):
    """The Accelerator of this launch, once the batch splits over its processes and the
    launch is one this trainer's checkpoints support (plain data-parallel)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    log_with = None if cfg.report_to == "none" else cfg.report_to
    accelerator = Accelerator(
        mixed_precision=cfg.mixed_precision,
        log_with=log_with,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / "logs")),
    )
    cfg.validate(accelerator.num_processes)
    kind = str(accelerator.distributed_type).upper()
    if any(name in kind for name in ("DEEPSPEED", "FSDP", "MEGATRON")):
        raise ValueError(f"accelerate's {accelerator.distributed_type} is not supported by this trainer's checkpoints; "
                         "launch plain data-parallel (accelerate launch --multi_gpu, or torchrun).")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and accelerator.num_processes == 1:
        # Every launched process would train alone (and all but one would find the folder busy).
        raise ValueError(f"launched as {world} processes (WORLD_SIZE={world}) but accelerate sees one; on CPU set "
                         "ACCELERATE_USE_CPU=1 for torchrun, or use accelerate launch --cpu.")
    return accelerator, log_with


def _train(cfg: TrainConfig, accelerator, lock: FolderLock, log_with: str | None) -> Path:
    """The steps of a run, in order (the caller releases ``lock``). Every process runs them;
    the folder's decisions are the main process's, handed to all."""
    from accelerate.utils import set_seed

    plan: Plan = on_main(accelerator, lambda: probe_and_plan(lock, cfg))
    _check_init_resume(cfg, plan)
    if accelerator.device.type == "cuda":
        set_tf32(cfg.allow_tf32)
    set_seed(cfg.seed, device_specific=True)
    data = _build_data(cfg, accelerator)  # validated before any model or VAE work
    space = _build_latent_space(cfg, data.dataset, accelerator.device)
    model, model_config = _build_model(cfg, space, data.classes)
    run = {"run_id": plan.run_id, **run_identity(cfg), "model_config": model_config}
    on_main(accelerator, lambda: claim_folder(cfg, plan, lock, model_config, accelerator.print))
    ctx = _prepare_training(cfg, accelerator, model, data, space, run, log_with)
    ctx.last_checkpoint = plan.resume_from  # what a divergence names until the first checkpoint of this start
    if plan.resume_from is not None:
        load_checkpoint(ctx.parts, Path(plan.resume_from))
        accelerator.print(f"Resumed from {plan.resume_from} at step {ctx.parts.state.step}.")
    if accelerator.is_main_process:  # written only once the state has loaded
        record_run(cfg, {"run_id": plan.run_id, "data_path": run["data_path"],
                         "num_processes": accelerator.num_processes, "per_process_batch_size": data.per_process,
                         "latent_shape": list(space.shape), "model_config": model_config},
                   data.class_to_idx, ctx.parts.state.step)
    if log_with is not None:
        accelerator.init_trackers("moh-dit", config={k: v for k, v in dataclasses.asdict(cfg).items()
                                                     if isinstance(v, (int, float, str, bool))})
    run_loop(ctx, data.batches())
    return _finish(ctx, data.class_to_idx)


def _build_data(cfg: TrainConfig, accelerator) -> _Data:
    if cfg.latents_dir is not None:
        dataset = LatentDataset(cfg.latents_dir, random_flip=cfg.random_flip, seed=cfg.seed)
    else:
        dataset = ImageFolderDataset(
            cfg.data_dir, cfg.image_size, random_flip=cfg.random_flip, seed=cfg.seed, on_corrupt=cfg.on_corrupt
        )
    per_process = cfg.global_batch_size // accelerator.num_processes
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


def _build_latent_space(cfg: TrainConfig, dataset, device: torch.device) -> LatentSpace:
    """A latent cache's space, pixels (``--vae none``), or the VAE's latents (the VAE loaded here)."""
    if cfg.latents_dir is not None:
        return LatentSpace(tuple(dataset.latent_shape), None, dataset.scaling_factor)
    if cfg.vae.lower() == "none":
        return LatentSpace((3, cfg.image_size, cfg.image_size), None, None)
    vae = load_vae(cfg.vae, cfg.vae_subfolder, device=device)
    factor = vae_downsample_factor(vae)
    if cfg.image_size % factor:
        raise ValueError(f"--image-size {cfg.image_size} is not divisible by the VAE's downsampling factor {factor}.")
    size = cfg.image_size // factor
    return LatentSpace((vae.config.latent_channels, size, size), vae, vae.config.scaling_factor)


def _build_model(cfg: TrainConfig, space: LatentSpace, classes: list[str]):
    """The preset's model for this data, and its config as the run records it."""
    overrides = dict(cfg.model_overrides)
    overrides.update(sample_size=space.shape[1], in_channels=space.shape[0], num_classes=len(classes),
                     class_dropout_prob=cfg.class_dropout, class_names=list(classes))
    model = MoHDiTTransformer2DModel.from_preset(cfg.preset, **overrides)
    model_config = normalized({k: v for k, v in dict(model.config).items() if not k.startswith("_")})
    if cfg.init_from is not None:
        _load_init_weights(cfg, model, model_config)
    return model, model_config


# Settings of a saved model that --init-from may differ in: the run sets them from its data and flags.
_INIT_FREE_KEYS = ("class_names", "class_dropout_prob")


def _per_layer_config(config: dict) -> dict:
    """``config`` with heads, shared heads and top-K as per-layer lists (4 heads == [4] * layers)."""
    heads, shared, k = resolve_layer_layout(config["num_layers"], config["num_attention_heads"],
                                            config.get("num_shared_heads"), config.get("top_k"))
    return {**config, "num_attention_heads": heads, "num_shared_heads": shared, "top_k": k}


def _load_init_weights(cfg: TrainConfig, model: MoHDiTTransformer2DModel, model_config: dict) -> None:
    """``--init-from``: the saved model's weights into ``model``, once its layout is the one
    the preset builds for this data (every constructor argument but class names and dropout)."""
    try:
        source = MoHDiTTransformer2DModel.from_pretrained(cfg.init_from)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--init-from {cfg.init_from}: cannot load the model ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}).") from None
    theirs = _per_layer_config(normalized({k: v for k, v in dict(source.config).items() if not k.startswith("_")}))
    ours = _per_layer_config(model_config)
    diffs = [f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in sorted(set(theirs) | set(ours))
             if k not in _INIT_FREE_KEYS and theirs.get(k) != ours.get(k)]
    if diffs:
        raise ValueError(f"--init-from {cfg.init_from} does not fit --preset {cfg.preset} on this data: "
                         f"{'; '.join(diffs)}. Use the preset the model was made for (scripts/upcycle.py prints it) "
                         "and data of its size and classes.")
    names = theirs.get("class_names")
    if names is not None and names != model_config.get("class_names"):
        warn(f"--init-from {cfg.init_from} was trained with classes {names[:5]}..., this data's are "
             f"{(model_config.get('class_names') or [])[:5]}...; class ids keep their embeddings.")
    model.load_state_dict(source.state_dict(), strict=True)


def _check_init_resume(cfg: TrainConfig, plan: Plan) -> None:
    """A run that started from --init-from and has no checkpoint yet cannot continue: without
    the flag (refused with --resume) it would silently start from random weights."""
    started_from = (plan.record or {}).get("init_from")
    if cfg.resume is not None and plan.resume_from is None and started_from:
        raise ValueError(f"--output-dir {cfg.output_dir} holds a run started with --init-from {started_from} that "
                         "has no checkpoint yet; start it again with --init-from into another --output-dir.")


def _prepare_training(cfg: TrainConfig, accelerator, model, data: _Data, space: LatentSpace, run: dict[str, Any],
                      log_with: str | None) -> LoopContext:
    """EMA (an exact copy of the initial model), diffusion, AdamW and the warmup schedule,
    prepared by accelerate."""
    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    ema = copy.deepcopy(model).to(accelerator.device).requires_grad_(False).eval()
    model.train()
    if cfg.compile:  # in place, after the EMA copy: state-dict keys stay the model's own
        compile_model(model, mode=cfg.compile_mode, per_block=cfg.compile_per_block)
    diffusion = create_diffusion()
    # The fused kernel (one launch for all parameters) where the device has it; else torch's default.
    fused = {"fused": True} if accelerator.device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  betas=tuple(cfg.adam_betas), **fused)
    warmup = max(cfg.warmup_steps, 0)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    # EMA and step/data position are saved by this package (safetensors + JSON), not
    # registered with accelerate, whose custom state is a pickle loaded with weights_only=False.
    parts = Parts(accelerator, accelerator.unwrap_model(model), ema, optimizer, lr_scheduler, TrainState(data.sampler))
    held = [p for name, p in model.named_parameters() if ".router_" not in name] if cfg.router_warmup_steps else []
    flops, peak = _mfu_terms(cfg, accelerator, parts.model)
    return LoopContext(cfg=cfg, parts=parts, model=model, diffusion=diffusion, space=space, sampler=data.sampler,
                       per_process=data.per_process, num_classes=len(data.classes), run=run, log_with=log_with,
                       last_checkpoint=None, held_in_warmup=held, flops_per_image=flops, peak_flops=peak)


def _mfu_terms(cfg: TrainConfig, accelerator, model) -> tuple[int, float]:
    """One training step's FLOPs per image and one device's peak FLOP/s (a datasheet figure
    for known GPUs, else a timed matmul: said once at the start), for the MFU in the logs."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.mixed_precision, torch.float32)
    peak, source = peak_flops(accelerator.device, dtype, allow_tf32=cfg.allow_tf32)
    accelerator.print(f"MFU is measured against the {source}.")
    return training_flops_per_image(model), peak


def _finish(ctx: LoopContext, class_to_idx: dict[str, int]) -> Path:
    """``OUT/final``: the EMA model and its class map, published whole by the main process."""
    accelerator = ctx.parts.accelerator
    if ctx.parts.state.images_skipped:
        accelerator.print(f"Skipped {ctx.parts.state.images_skipped} unreadable images (--on-corrupt skip).")
    final = Path(ctx.cfg.output_dir) / "final"
    if accelerator.is_main_process:
        # Replaces only this run's previous export: a refused start protects any other.
        with publish_folder(final, replace=True) as tmp:
            ctx.parts.ema.save_pretrained(tmp, safe_serialization=True)
            write_class_index(class_to_idx, tmp / "class_index.json")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final
