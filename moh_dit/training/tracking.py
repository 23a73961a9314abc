"""Experiment trackers (``report_to``) through accelerate's tracker API.

A tracker that is asked for but not installed stops the run before any work, naming what to
install: accelerate alone would warn once and train with no tracking at all. Without
``report_to`` the run uses TensorBoard when it is installed (the default of diffusers'
example scripts) and no tracker otherwise, and says which. Images (the sample grids, and a MoH
model's head-usage figure at the same steps) go to the trackers that take them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidInput
from ..utils.io import write_bytes_atomic

# The trackers report_to offers, each with what installs it.
INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb"}
REPORT_TO = (*INSTALL, "none")


def available_trackers() -> set[str]:
    """The trackers accelerate finds installed, by name."""
    from accelerate.tracking import get_available_trackers

    return {str(getattr(t, "value", t)) for t in get_available_trackers()}


def check_installed(report_to: str | None) -> None:
    """Refuse a requested tracker that is not installed (before any work)."""
    if report_to in INSTALL and report_to not in available_trackers():
        raise InvalidInput(f"report_to {report_to}: {report_to} is not installed. Install it with "
                           f"{INSTALL[report_to]}, or set report_to to 'none' to train without a tracker.",
                           parameters="report_to")


def resolve_report_to(report_to: str | None) -> tuple[str, str]:
    """The tracker a run uses and why: ``report_to``, or without it TensorBoard if it is
    installed, else none."""
    if report_to is not None:
        return report_to, "report_to"
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


def last_logged_usage(log: Path) -> tuple[int, list[list[float]]] | None:
    """(step, per-layer usage) of the last complete line of a run's ``head_usage.jsonl``, or None
    when there is none: what a resumed run shows until it logs again."""
    if not log.is_file():
        return None
    for line in reversed(log.read_text(encoding="utf-8").splitlines()):
        try:
            entry = json.loads(line)
            return int(entry["step"]), entry["usage"]
        except (ValueError, KeyError, TypeError):
            continue  # a half-written line
    return None


def save_head_usage_figure(accelerator, logged: tuple[int, list[list[float]]], shared_heads: list[int],
                           top_k: list[int], step: int, path: Path) -> None:
    """The head-usage figure (:func:`~moh_dit.evaluation.head_usage.plot_head_usage`: layers as
    rows, heads as columns, shared heads hatched) of ``logged``, the usage the run logged last
    (its step, per layer the fraction of tokens that used each head), as the PNG ``path`` and to
    every tracker that takes images (``head_usage``) at ``step``."""
    from ..evaluation.head_usage import TRAINING_STEP, HeadUsage, plot_head_usage
    from ..utils.figures import figure_png, figure_rgb

    logged_step, usage = logged
    figure = plot_head_usage(
        HeadUsage(overall=usage, per_class={}, per_timestep=[], shared_heads=shared_heads, top_k=top_k,
                  ranges_of=TRAINING_STEP, settings={"step": logged_step}),
        f"head usage at step {logged_step}", subtitle="fraction of tokens that used each head, in the batch of the "
        f"last logged step ({logged_step})")
    write_bytes_atomic(path, figure_png(figure))
    rgb = figure_rgb(figure)  # (H, W, 3)
    log_images(accelerator, "head_usage", torch.from_numpy(rgb).permute(2, 0, 1)[None].float() / 255, step)
