"""The paper's diffusion (1000 linear betas 1e-4..0.02) as diffusers schedulers, for sampling.

:mod:`moh_dit.diffusion.gaussian_diffusion` owns the same process for training (losses, the VB
term); the pipeline samples through diffusers' schedulers, built here, so that a saved pipeline
folder holds a scheduler any diffusers install can read.
"""

from __future__ import annotations

from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin

__all__ = ["SCHEDULERS", "make_scheduler", "uses_learned_variance"]

SCHEDULERS = ("ddpm", "ddim", "dpm")


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
    steps differ by one (pass ``timesteps=`` to the pipeline for an exact list).
    ``"ddim"``: deterministic DDIM (eta via the pipeline), same spacing, final alpha 1.
    ``"dpm"``: DPM-Solver++ (2nd order multistep). DDIM and DPM-Solver use the eps half only.

    ``clip_sample`` clamps the predicted x0 to [-1, 1] (IDDPM's ``clip_denoised``). It is off
    by default because DiT samples latents, which are not bounded (DiT's sample.py passes
    ``clip_denoised=False``); pixel-space models trained on [-1, 1] images may turn it on.
    """
    common = dict(
        num_train_timesteps=num_train_timesteps, beta_schedule="linear", beta_start=beta_start, beta_end=beta_end,
        prediction_type="epsilon",
    )
    if kind == "ddpm":
        return DDPMScheduler(**common, variance_type="learned_range", clip_sample=clip_sample, timestep_spacing="linspace")
    if kind == "ddim":
        return DDIMScheduler(**common, clip_sample=clip_sample, set_alpha_to_one=True, steps_offset=0, timestep_spacing="linspace")
    if kind == "dpm":
        if clip_sample:
            raise ValueError("DPM-Solver has no x0 clipping; use clip_sample=False (or its `thresholding`).")
        return DPMSolverMultistepScheduler(**common, algorithm_type="dpmsolver++", solver_order=2, timestep_spacing="linspace")
    raise ValueError(f"Unknown scheduler kind {kind!r}; choose one of {SCHEDULERS}.")


def uses_learned_variance(scheduler: SchedulerMixin, learns_sigma: bool) -> bool:
    """Whether ``scheduler`` consumes a model's variance channels (DDPM ``learned_range``).

    DiT models predict IDDPM's interpolation values between the posterior's two variance
    bounds, which is what DDPM's ``learned_range`` reads; every other pairing of scheduler and
    model raises ValueError with the scheduler to build instead. ``learns_sigma``: the model
    outputs the variance channels after the eps ones.
    """
    variance_type = getattr(scheduler.config, "variance_type", None)
    if isinstance(scheduler, DDPMScheduler):
        if variance_type == "learned":
            raise ValueError(
                "DDPMScheduler(variance_type='learned') reads the output as a log variance, but DiT models predict "
                "IDDPM's interpolation values: use variance_type='learned_range'."
            )
        if variance_type == "learned_range":
            if not learns_sigma:
                raise ValueError(
                    "The scheduler uses variance_type='learned_range' but this model does not learn sigma "
                    "(learn_sigma=False); use a fixed variance type, e.g. "
                    "DDPMScheduler.from_config(pipe.scheduler.config, variance_type='fixed_small')."
                )
            return True
        return False
    if variance_type in ("learned", "learned_range"):
        # DPM-Solver would slice the output to 3 channels itself; the pipeline already
        # hands it the eps half.
        raise ValueError(
            f"{type(scheduler).__name__} has variance_type={variance_type!r}; the pipeline passes it the eps "
            "half already: rebuild it with variance_type=None, e.g. "
            f"{type(scheduler).__name__}.from_config(pipe.scheduler.config, variance_type=None)."
        )
    return False
