"""The noise: DiT's Gaussian diffusion for training (losses with the VB term, respacing, the
ancestral step) and ``make_scheduler``, the same process as a diffusers scheduler for sampling
(defined beside the pipeline, so that an exported pipeline file carries it)."""

from __future__ import annotations

from typing import Any

from .gaussian_diffusion import GaussianDiffusion, create_diffusion, space_timesteps

__all__ = ["GaussianDiffusion", "create_diffusion", "space_timesteps", "make_scheduler"]


def __getattr__(name: str) -> Any:
    if name == "make_scheduler":  # imported when used: the pipeline module loads diffusers' pipelines
        from ..pipelines.pipeline_moh_dit import make_scheduler

        return make_scheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
