"""What changes with the optimiser step: the learning rate and the EMA decay.

Both are functions of the step alone, so a resumed run picks them up where it stopped: the
LR schedule is saved with each checkpoint (``scheduler.json``), and the EMA decay of step
``n`` needs nothing but ``n``.
"""

from __future__ import annotations

import math

# diffusers.optimization's schedules that need nothing beyond a warm-up and a run length
# (the choices of diffusers' example training scripts).
LR_SCHEDULERS = ("constant_with_warmup", "constant", "linear", "cosine", "cosine_with_restarts", "polynomial")

# diffusers' EMAModel defaults for the warm-up.
EMA_INV_GAMMA = 1.0
EMA_POWER = 2 / 3


def build_lr_scheduler(name: str, optimizer, warmup_steps: int, max_steps: int):
    """diffusers' ``get_scheduler(name)`` over ``max_steps`` optimiser steps. It is stepped
    once per optimiser step by the trainer (not through accelerate, which would step it once
    per process and make the schedule depend on the launch)."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_steps)


def ema_decay_at(step: int, decay: float, warmup: bool = False, inv_gamma: float = EMA_INV_GAMMA,
                 power: float = EMA_POWER) -> float:
    """The EMA decay applied after optimiser step ``step`` (1 for the first).

    Without warm-up it is ``decay`` throughout (DiT's constant EMA from an exact copy). With
    warm-up it is diffusers' ``EMAModel`` schedule, ``min(decay, 1 - (1 + t / inv_gamma) ** -power)``
    with ``t = step - 1``: 0 after the first step (the EMA becomes that step's weights), then
    rising towards ``decay``."""
    if not warmup:
        return decay
    t = max(step - 1, 0)
    return min(decay, 1.0 - (1.0 + t / inv_gamma) ** -power)


def initial_weight_share(max_steps: int, decay: float, warmup: bool = False) -> float:
    """How much of the initial weights the EMA still holds after ``max_steps`` steps: the
    product of the decays. With warm-up the first decay is 0, so none."""
    if warmup or decay <= 0.0:
        return 0.0
    return math.exp(max_steps * math.log(decay))
