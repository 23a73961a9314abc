"""The noise: DiT's Gaussian diffusion (schedules, training losses with the VB term, samplers) and
the same process as diffusers schedulers for the pipeline (``make_scheduler``)."""

from .gaussian_diffusion import (GaussianDiffusion, approx_standard_normal_cdf, create_diffusion,
                                 discretized_gaussian_log_likelihood, linear_beta_schedule, mean_flat, normal_kl,
                                 space_timesteps)
from .schedulers import SCHEDULERS, eps_only_config, make_scheduler, scheduler_takes_variance

__all__ = ["GaussianDiffusion", "create_diffusion", "linear_beta_schedule", "space_timesteps", "normal_kl",
           "approx_standard_normal_cdf", "discretized_gaussian_log_likelihood", "mean_flat", "SCHEDULERS",
           "make_scheduler", "scheduler_takes_variance", "eps_only_config"]
