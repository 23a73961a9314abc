"""Stopping on NaN / inf latents during sampling, named by the first bad step.

A guidance scale too large for float32, or NaN in the weights, turns the latents non-finite;
without a check the pipeline would decode them into black images and report success.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["FiniteWatch", "NonFiniteLatentsError"]


class NonFiniteLatentsError(ValueError):
    """Sampling produced NaN or inf latents. A ValueError, so that the scripts report it as one
    line: it comes from the settings (a guidance scale too large for float32) or the weights."""


class FiniteWatch:
    """Finds the first sampling step whose latents hold NaN or inf, without a per-step host sync
    on accelerators.

    On the CPU each step is checked as it finishes: reading the flag costs nothing there and a
    doomed run stops at once. On CUDA (and any other device) ``bool(torch.isfinite(x).all())``
    would wait for the GPU every step and stall the kernel queue, so the check stays on the
    device: a 0-d tensor keeps the smallest bad step index (``torch.minimum`` with
    ``torch.where``, no sync), and it is read once after the loop, where the final copy to the
    host synchronises anyway. Either way the error names the first bad step.
    """

    def __init__(self, device: torch.device, num_steps: int, eager: bool | None = None):
        self.eager = device.type == "cpu" if eager is None else eager
        self.num_steps = num_steps
        self.first_bad: int | torch.Tensor | None = (
            None if self.eager else torch.full((), num_steps, dtype=torch.long, device=device)
        )

    def update(self, index: int, x: torch.Tensor) -> bool:
        """Record step ``index``'s latents; True when the run should stop (CPU, bad step)."""
        finite = torch.isfinite(x).all()
        if self.eager:
            if not bool(finite):
                self.first_bad = index
                return True
            return False
        self.first_bad = torch.minimum(self.first_bad, torch.where(finite, self.num_steps, index))
        return False

    def first_bad_step(self) -> int | None:
        """The index of the first step with non-finite latents, or None."""
        if self.first_bad is None:
            return None
        index = int(self.first_bad)
        return None if index >= self.num_steps else index

    def error(self, timesteps: Sequence[int] | torch.Tensor, guidance_scale: float) -> NonFiniteLatentsError | None:
        """The error to raise for the run's ``timesteps``, or None when every step was finite."""
        bad = self.first_bad_step()
        if bad is None:
            return None
        return NonFiniteLatentsError(
            f"sampling produced NaN/inf latents at step {bad + 1} of {len(timesteps)} (step index {bad}, "
            f"timestep {int(timesteps[bad])}); no images are returned. A guidance scale too large for "
            f"float32 (guidance_scale={guidance_scale:g}) or NaN/inf in the model's weights or the given "
            "latents causes this: lower the guidance scale or check the checkpoint."
        )
