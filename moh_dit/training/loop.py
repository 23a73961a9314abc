"""The step loop: one optimiser step per batch, then its log, sample grid and checkpoint.

Each concern is one function, in the order :func:`run_loop` calls them: :func:`_next_batch`
(data position, VAE encoding), :func:`_train_step` (loss, update, EMA), :func:`_stop_if_diverged`
(the finite check, at the steps that write),
:func:`_log_window` (averages over the steps since the last log, head usage),
:func:`_save_sample_grid` and the checkpoint. The order of random draws is the one a resumed
run replays, so nothing here may add, drop or reorder one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ..utils.io import atomic_write
from .checkpoints import Parts, save_checkpoint
from .config import TrainConfig
from .errors import TrainingDivergedError


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
        x = vae.decode(x / vae.config.scaling_factor).sample
    return ((x.clamp(-1, 1) + 1) / 2).float().cpu()


@dataclass
class LatentSpace:
    """What the model denoises: latents of ``vae`` scaled by ``scaling`` (encoded on the fly),
    a latent cache's (``vae`` None, already scaled), or pixels (both None)."""

    shape: tuple[int, int, int]  # (C, h, w)
    vae: Any | None
    scaling: float | None


@dataclass
class LoopContext:
    """Everything the loop reads, and the one thing it updates besides ``parts``: the last
    checkpoint written (or resumed from), which a divergence error names."""

    cfg: TrainConfig
    parts: Parts  # what checkpoints save; parts.model is the unwrapped model
    model: torch.nn.Module  # as accelerate prepared it: forward and backward go through this
    diffusion: Any
    space: LatentSpace
    sampler: Any  # the ResumableSampler feeding this process
    per_process: int  # batch size of this process
    num_classes: int
    run: dict[str, Any]  # the run identity every checkpoint marker records
    log_with: str | None
    last_checkpoint: str | Path | None
    held_in_warmup: list[torch.nn.Parameter] = field(default_factory=list)  # all but the routers (router warm-up)
    flops_per_image: int | None = None  # one training step's FLOPs per image (moh_dit.utils.speed), for MFU
    peak_flops: float | None = None  # one device's peak FLOP/s; None: no MFU


@dataclass
class _Step:
    """One step's terms, detached, for the log window."""

    loss: torch.Tensor
    mse: torch.Tensor
    vb: torch.Tensor
    lb: torch.Tensor
    grad_norm: Any  # a tensor, or a float from accelerate's clipping
    head_usage: list[torch.Tensor] | None


@dataclass
class _LogWindow:
    """Sums over the steps since the last log (on-device tensors until the log reduces them)."""

    sums: dict[str, Any] = field(default_factory=lambda: {"loss": 0.0, "mse": 0.0, "vb": 0.0, "lb": 0.0,
                                                          "grad_norm": 0.0})
    count: int = 0
    images: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, step: _Step, images: int) -> None:
        self.images += images
        self.sums["loss"] += step.loss
        self.sums["mse"] += step.mse
        self.sums["vb"] += step.vb
        self.sums["lb"] += step.lb
        self.sums["grad_norm"] += step.grad_norm.detach() if torch.is_tensor(step.grad_norm) else step.grad_norm
        self.count += 1


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


def _next_batch(ctx: LoopContext, batches: Iterator) -> tuple[torch.Tensor, torch.Tensor]:
    """The next batch on the device, the data position advanced, latents encoded if a VAE is in use."""
    device, state, vae = ctx.parts.accelerator.device, ctx.parts.state, ctx.space.vae
    x, y = next(batches)
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= ctx.num_classes):  # on the host, before the copy
        raise ValueError(f"the data gave class ids in [{int(y.min())}, {int(y.max())}], outside [0, "
                         f"{ctx.num_classes - 1}]: the dataset and the model's classes disagree.")
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    ctx.sampler.advance(ctx.per_process)
    state.images_skipped += ctx.per_process - x.shape[0]  # unreadable images dropped (--on-corrupt skip)
    if vae is not None:
        with torch.no_grad():
            shift = getattr(vae.config, "shift_factor", None) or 0.0
            x = (vae.encode(x).latent_dist.sample() - shift) * ctx.space.scaling
    return x, y


def _stop_if_diverged(ctx: LoopContext, watch: _DivergenceWatch) -> None:
    """Raise TrainingDivergedError on every process if the loss was NaN/inf at any step so
    far on any of them, naming the first such step (one host sync, at log, sample and
    checkpoint steps only)."""
    acc = ctx.parts.accelerator
    first = watch.first.reshape(1)
    terms = watch.terms.reshape(1, 4)
    if acc.num_processes > 1:  # decided together: a rank that stopped alone would leave the others waiting
        first, terms = acc.gather(first), acc.gather(terms)
    steps = first.tolist()
    bad = [(step, rank) for rank, step in enumerate(steps) if step >= 0]
    if not bad:
        return
    step, rank = min(bad)
    loss, mse, vb, lb = terms[rank].tolist()
    where = f" on process {rank}" if acc.num_processes > 1 else ""
    raise TrainingDivergedError(
        f"The loss became {loss} at step {step}{where} (mse {mse:.4g}, vb {vb:.4g}, lb {lb:.4g}). "
        f"The last good checkpoint is {ctx.last_checkpoint or 'none'}; lower --learning-rate, set --max-grad-norm, "
        "or use bf16 instead of fp16, then resume."
    )


def _train_step(ctx: LoopContext, x: torch.Tensor, y: torch.Tensor, log_now: bool) -> _Step:
    """One optimiser step on (x, y): diffusion loss plus ``lb_coeff`` times the load-balance
    loss, backward, clipping, AdamW, the LR schedule and the EMA."""
    cfg, acc, parts, diffusion = ctx.cfg, ctx.parts.accelerator, ctx.parts, ctx.diffusion
    t = diffusion.sample_timesteps(x.shape[0], device=acc.device)
    noise = torch.randn_like(x)
    x_t = diffusion.q_sample(x, t, noise)
    with acc.autocast():
        out = ctx.model(x_t, t, y, output_load_balance_loss=True, output_head_usage=log_now and parts.model.is_moh)
    terms = diffusion.training_losses(out.sample, x, x_t, t, noise)
    loss = terms["loss"].mean() + cfg.lb_coeff * out.load_balance_loss
    acc.backward(loss)
    if parts.state.step < cfg.router_warmup_steps:
        # Router warm-up: the other parameters get no gradient, so AdamW skips them entirely
        # (no moment, no step count, no weight decay); their first update comes after it.
        for param in ctx.held_in_warmup:
            param.grad = None
    grad_norm = acc.clip_grad_norm_(ctx.model.parameters(), cfg.max_grad_norm or float("inf"))
    parts.optimizer.step()
    parts.lr_scheduler.step()
    parts.optimizer.zero_grad(set_to_none=True)
    update_ema(parts.ema, parts.model, cfg.ema_decay)
    parts.state.step += 1
    parts.state.images_seen += cfg.global_batch_size
    return _Step(loss.detach(), terms["mse"].mean().detach(), terms["vb"].mean().detach(),
                 out.load_balance_loss.detach(), grad_norm, out.head_usage)


def _head_balance(ctx: LoopContext, head_usage: list[torch.Tensor], logs: dict[str, Any]) -> None:
    """Per-layer balance of the routed heads into ``logs``; the usage itself into head_usage.jsonl."""
    for i, usage in enumerate(head_usage):
        routed = usage[ctx.parts.model.layer_shared[i]:]
        if routed.numel() > 1:
            # coefficient of variation of routed-head usage: 0 = perfectly balanced
            logs[f"head_balance_cv/layer_{i:02d}"] = (routed.std() / routed.mean().clamp_min(1e-8)).item()
    if ctx.parts.accelerator.is_main_process:
        with open(Path(ctx.cfg.output_dir) / "head_usage.jsonl", "a") as f:
            f.write(json.dumps({"step": ctx.parts.state.step, "usage": [u.tolist() for u in head_usage]}) + "\n")


def _log_window(ctx: LoopContext, window: _LogWindow, step: _Step, progress) -> None:
    """Averages over all processes of the steps since the last log, speed, LR and skipped
    images: to the trackers, the progress bar and train_log.jsonl."""
    acc, state = ctx.parts.accelerator, ctx.parts.state
    elapsed = time.perf_counter() - window.start
    logs = {k: float(acc.reduce(torch.as_tensor(v, device=acc.device, dtype=torch.float32), "mean")) / window.count
            for k, v in window.sums.items()}
    logs.update(steps_per_sec=window.count / elapsed, images_per_sec=window.images / elapsed,
                lr=ctx.parts.lr_scheduler.get_last_lr()[0], images_skipped=state.images_skipped)
    if ctx.flops_per_image and ctx.peak_flops:
        logs["mfu"] = logs["images_per_sec"] * ctx.flops_per_image / (ctx.peak_flops * acc.num_processes)
    if ctx.parts.model.is_moh and step.head_usage is not None:
        _head_balance(ctx, step.head_usage, logs)
    if ctx.log_with is not None:
        acc.log(logs, step=state.step)
    if progress is not None:
        speed = {"it_s": f"{logs['steps_per_sec']:.2f}", "img_s": f"{logs['images_per_sec']:.1f}"}
        if "mfu" in logs:
            speed["mfu"] = f"{100 * logs['mfu']:.1f}%"
        progress.set_postfix(loss=f"{logs['loss']:.4f}", mse=f"{logs['mse']:.4f}", lb=f"{logs['lb']:.3f}", **speed)
        with open(Path(ctx.cfg.output_dir) / "train_log.jsonl", "a") as f:
            f.write(json.dumps({"step": state.step, **logs}) + "\n")


def _save_sample_grid(ctx: LoopContext) -> None:
    """``OUT/samples/step-N.png``: an EMA sample grid, four rows of up to 16 classes."""
    from torchvision.utils import save_image

    cfg, space, step = ctx.cfg, ctx.space, ctx.parts.state.step
    images = sample_grid(ctx.parts.ema, ctx.diffusion, ctx.num_classes, space.shape, space.vae,
                         steps=cfg.sample_steps, per_class=4, seed=cfg.seed, device=ctx.parts.accelerator.device)
    with atomic_write(Path(cfg.output_dir) / "samples" / f"step-{step:07d}.png") as f:
        save_image(images, f, nrow=min(ctx.num_classes, 16), format="png")


def _progress_bar(ctx: LoopContext):
    if not ctx.parts.accelerator.is_main_process:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=ctx.cfg.max_steps, initial=ctx.parts.state.step, desc="train", dynamic_ncols=True)


def run_loop(ctx: LoopContext, batches: Iterator) -> None:
    """Train from the current step to ``cfg.max_steps``; after each step, its log (every
    ``log_every`` and at the end), sample grid (``sample_every``, main process) and
    checkpoint (every ``checkpoint_every`` and at the end). The loss is checked for NaN/inf
    at each of those steps, before anything is written (:class:`_DivergenceWatch`); in
    between, nothing waits for the device."""
    cfg, acc, state = ctx.cfg, ctx.parts.accelerator, ctx.parts.state
    window = _LogWindow()
    watch = _DivergenceWatch(acc.device)
    progress = _progress_bar(ctx)
    while state.step < cfg.max_steps:
        x, y = _next_batch(ctx, batches)
        log_now = (state.step + 1) % cfg.log_every == 0 or state.step + 1 == cfg.max_steps
        step = _train_step(ctx, x, y, log_now)
        watch.update(state.step, step)
        window.add(step, cfg.global_batch_size)
        if progress is not None:
            progress.update(1)
        sample_now = bool(cfg.sample_every) and state.step % cfg.sample_every == 0
        checkpoint_now = state.step % cfg.checkpoint_every == 0 or state.step == cfg.max_steps
        if log_now or sample_now or checkpoint_now:  # on every process: the check is collective
            _stop_if_diverged(ctx, watch)
        if log_now:
            _log_window(ctx, window, step, progress)
            window = _LogWindow()
        if sample_now and acc.is_main_process:
            _save_sample_grid(ctx)
        if checkpoint_now:
            ctx.last_checkpoint = save_checkpoint(ctx.parts, cfg, state.step, ctx.run)
    if progress is not None:
        progress.close()
