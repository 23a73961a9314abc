"""Experiment trackers (``--report-to``) through accelerate's tracker API.

A tracker that is asked for but not installed stops the run before any work, naming what to
install: accelerate alone would warn once and train with no tracking at all. Without
``--report-to`` the run uses TensorBoard when it is installed (the default of diffusers'
example scripts) and no tracker otherwise, and says which.
"""

from __future__ import annotations

from typing import Any

import torch

# The trackers --report-to offers, each with what installs it.
INSTALL = {"tensorboard": 'pip install "moh-dit[tensorboard]"', "wandb": "pip install wandb"}
REPORT_TO = (*INSTALL, "none")


def available_trackers() -> set[str]:
    """The trackers accelerate finds installed, by name."""
    from accelerate.tracking import get_available_trackers

    return {str(getattr(t, "value", t)) for t in get_available_trackers()}


def check_installed(report_to: str | None) -> None:
    """Refuse a requested tracker that is not installed (before any work)."""
    if report_to in INSTALL and report_to not in available_trackers():
        raise ValueError(f"--report-to {report_to}: {report_to} is not installed. Install it with "
                         f"{INSTALL[report_to]}, or pass --report-to none to train without a tracker.")


def resolve_report_to(report_to: str | None) -> tuple[str, str]:
    """The tracker a run uses and why: the flag's value, or without it TensorBoard if it is
    installed, else none."""
    if report_to is not None:
        return report_to, "--report-to"
    if "tensorboard" in available_trackers():
        return "tensorboard", "the default, as it is installed"
    return "none", f"TensorBoard is not installed ({INSTALL['tensorboard']} for it)"


def log_with(report_to: str) -> Any:
    """What accelerate's ``Accelerator(log_with=...)`` takes for ``report_to``."""
    return None if report_to == "none" else report_to


def log_images(accelerator, name: str, images: torch.Tensor, step: int) -> None:
    """``images`` (N, 3, H, W) in [0, 1] to every tracker that takes images (TensorBoard's
    and wandb's ``log_images``); the others log scalars only."""
    for tracker in accelerator.trackers:
        if hasattr(tracker, "log_images"):
            tracker.log_images({name: images}, step=step)
