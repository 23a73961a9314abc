"""The paper's diffusion (1000 linear betas 1e-4..0.02) as diffusers schedulers, for sampling.

:mod:`moh_dit.diffusion.gaussian_diffusion` owns the same process for training (losses, the VB
term); the pipeline samples through diffusers' schedulers, built here, so that a saved pipeline
folder holds a scheduler any diffusers install can read. Any other diffusers scheduler made the
diffusers way, ``X.from_config(pipe.scheduler.config)``, works too: :func:`scheduler_takes_variance`
decides what it is handed and refuses the ones that cannot sample an eps-predicting model.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler
from diffusers.schedulers.scheduling_ddpm_parallel import DDPMParallelScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin

__all__ = ["SCHEDULERS", "make_scheduler", "scheduler_takes_variance", "eps_only_config"]

SCHEDULERS = ("ddpm", "ddim", "dpm")
# The schedulers whose step reads IDDPM's learned-range variance values after the eps channels.
_LEARNED_VARIANCE_STEPS = (DDPMScheduler, DDPMParallelScheduler)
_LEARNED = ("learned", "learned_range")
_ALTERNATIVES = "DDPMScheduler, DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler or UniPCMultistepScheduler"


def make_scheduler(
    kind: str = "ddpm",
    clip_sample: bool = False,
    num_train_timesteps: int = 1000,
    beta_start: float = 1e-4,
    beta_end: float = 0.02,
) -> SchedulerMixin:
    """A diffusers scheduler for the paper's diffusion (1000 linear betas 1e-4..0.02).

    ``"ddpm"``: ancestral sampling with the model's learned-range variance, i.e. DiT's /
    IDDPM's ``p_sample_loop`` (the paper's 250-step sampler). ``timestep_spacing="linspace"``
    keeps ``round(linspace(0, T-1, n))``, which equals ADM's ``space_timesteps(T, n)`` for
    round step counts (10, 25, 50, 100, 250, 500, ...); for some other counts a few kept
    steps differ by one (pass ``timesteps=`` to the pipeline for an exact list). DDPM steps to
    the next timestep of its list whatever the spacing.

    ``"ddim"``: deterministic DDIM (eta via the pipeline) on the strided timesteps
    ``0, s, 2s, ..., (n-1)s`` with ``s = T // n`` (``timestep_spacing="leading"``), because
    diffusers' DDIM always steps from ``t`` to ``t - T // n``: with any other spacing
    consecutive steps would use mismatched alphas. For every ``n`` that divides T (10, 20, 25,
    40, 50, 100, 125, 200, 250, 500) this is DiT's / IDDPM's ``ddim_sample_loop`` with
    ``"ddim{n}"`` respacing (50 steps: 0, 20, ..., 980). For other counts IDDPM takes the
    smallest stride giving exactly ``n`` steps (7 steps: 143, so 0..858) while this takes
    ``T // n`` (142, so 0..852): the same sampler on a slightly shifted set.

    ``"dpm"``: DPM-Solver++ (2nd order multistep), linspace spacing. DDIM and DPM-Solver take
    the eps half only.

    ``clip_sample`` clamps the predicted x0 to [-1, 1] (IDDPM's ``clip_denoised``). It is off
    by default because DiT samples latents, which are not bounded (DiT's sample.py passes
    ``clip_denoised=False``); pixel-space models trained on [-1, 1] images may turn it on.
    DDPM's step with clipping is IDDPM's as it stands. IDDPM's DDIM also re-derives eps from the
    clipped x0, which diffusers' ``DDIMScheduler.step`` does only with
    ``use_clipped_model_output=True``: ``MoHDiTPipeline`` passes it whenever the scheduler clips
    (or thresholds); a caller stepping the scheduler itself has to pass it too.
    """
    common = dict(
        num_train_timesteps=num_train_timesteps, beta_schedule="linear", beta_start=beta_start, beta_end=beta_end,
        prediction_type="epsilon",
    )
    if kind == "ddpm":
        return DDPMScheduler(**common, variance_type="learned_range", clip_sample=clip_sample, timestep_spacing="linspace")
    if kind == "ddim":
        return DDIMScheduler(**common, clip_sample=clip_sample, set_alpha_to_one=True, steps_offset=0, timestep_spacing="leading")
    if kind == "dpm":
        if clip_sample:
            raise ValueError("DPM-Solver has no x0 clipping; use clip_sample=False (or its `thresholding`).")
        return DPMSolverMultistepScheduler(**common, algorithm_type="dpmsolver++", solver_order=2, timestep_spacing="linspace")
    raise ValueError(f"Unknown scheduler kind {kind!r}; choose one of {SCHEDULERS}.")


def scheduler_takes_variance(scheduler: SchedulerMixin, learns_sigma: bool) -> bool:
    """Whether ``scheduler``'s step takes a model's variance channels after the eps ones.

    Decided by the scheduler's class, not by a ``variance_type`` key that ``from_config``
    carried over from another scheduler's config: only DDPM's step reads IDDPM's learned-range
    values (DiT's sampler); every other scheduler is handed the eps half, as diffusers'
    DiTPipeline does. Raises ValueError, naming the scheduler and what to use, for a scheduler
    that cannot sample this model: a flow-matching one, a prediction type other than eps, DDPM
    reading the values as a raw log variance, or learned range on a model without them.
    """
    name = type(scheduler).__name__
    if not hasattr(scheduler, "alphas_cumprod"):
        raise ValueError(
            f"{name} is not a DDPM-family scheduler (flow matching, or no alphas_cumprod), but the model predicts the "
            f"noise eps of a 1000-step DDPM diffusion; use {_ALTERNATIVES}, e.g. "
            "DDIMScheduler.from_config(pipe.scheduler.config) or moh_dit.diffusion.make_scheduler('ddpm')."
        )
    prediction = getattr(scheduler.config, "prediction_type", "epsilon")
    if prediction != "epsilon":
        raise ValueError(
            f"{name} has prediction_type={prediction!r}, but the model predicts eps; rebuild it with "
            f"{name}.from_config(pipe.scheduler.config, prediction_type='epsilon')."
        )
    variance_type = getattr(scheduler.config, "variance_type", None)
    if not isinstance(scheduler, _LEARNED_VARIANCE_STEPS) or variance_type not in _LEARNED:
        return False
    if variance_type == "learned":
        raise ValueError(
            f"{name}(variance_type='learned') reads the output as a log variance, but DiT models predict IDDPM's "
            f"interpolation values: use {name}.from_config(pipe.scheduler.config, variance_type='learned_range')."
        )
    if not learns_sigma:
        raise ValueError(
            f"{name} uses variance_type='learned_range' but this model does not learn sigma (learn_sigma=False); "
            f"use a fixed variance type, e.g. {name}.from_config(pipe.scheduler.config, variance_type='fixed_small')."
        )
    return True


@contextlib.contextmanager
def eps_only_config(scheduler: SchedulerMixin, takes_variance: bool) -> Iterator[None]:
    """While sampling, hide a learned ``variance_type`` from a scheduler that is handed eps only.

    DPM-Solver (and its relatives) given ``variance_type='learned_range'`` cut the output to its
    first three channels, which is right for an eps-and-variance RGB output but drops eps channels
    of a 4-channel latent model; the pipeline hands them the whole eps half already. The
    scheduler's config is given back on exit, also on error.
    """
    stale = getattr(scheduler.config, "variance_type", None)
    if takes_variance or stale not in _LEARNED:
        yield
        return
    scheduler.register_to_config(variance_type=None)
    try:
        yield
    finally:
        scheduler.register_to_config(variance_type=stale)
