"""Head-activation schedules: another head activation ratio at every denoising step.

A MoH-DiT can run each denoising step at its own head activation ratio: the routed top-K is
state on the model, set before each step. :class:`HeadActivationSchedule` says which ratio a
step asks for, from the step's index, its timestep and the number of steps
(:meth:`HeadActivationSchedule.ratio_at`). It is made from

* a number (the same ratio at every step),
* a text spec (:func:`parse_schedule`; the command line's syntax, see docs/sampling.md):
  ``linear:A:B`` (A at the first, noisiest step to B at the last, linear in the step's
  fraction of the trajectory), ``cosine:A:B`` (the same ends, half a cosine between them),
  ``step:R1@t>T1,R2`` (R1 while the timestep is above T1, else R2; more ``R@t>T`` pieces may
  come before the last ratio, the first whose condition holds wins) or a plain number,
* one ratio per step (:meth:`HeadActivationSchedule.per_step`),
* a function of the timestep (:meth:`HeadActivationSchedule.of_timestep`) or of the step's
  fraction of the trajectory, 0 at the first step and 1 at the last
  (:meth:`HeadActivationSchedule.of_fraction`).

What a schedule realises on a model is :func:`plan_head_activation`'s
:class:`HeadActivationPlan`: per step the requested ratio, the realised one (the model's
top-K rounding), the per-layer top-K and the ideal head-sparse attention FLOPs, each step
checked against the model's reachable range before anything runs. The model is left as it
was. Imports only ``flops`` and ``head_activation`` from the package.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import InvalidInput
from .flops import model_attention_flops
from .head_activation import HeadActivated, preview_head_activation

__all__ = [
    "SCHEDULE_EXAMPLES",
    "HeadActivationSchedule",
    "HeadActivationPlan",
    "as_schedule",
    "is_schedule_spec",
    "parse_schedule",
    "plan_head_activation",
    "schedule_setting",
    "split_ratio_list",
    "trajectory_fraction",
]

SCHEDULE_EXAMPLES = "e.g. 0.75, linear:0.5:1.0, cosine:1.0:0.5 or step:0.5@t>500,1.0"
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_PIECE = re.compile(rf"\s*({_NUMBER})\s*@\s*t\s*>\s*(\d+)\s*")


def _fmt(value: float) -> str:
    """A ratio as the shortest text that reads back as the same float (1.0 -> '1', 0.75 -> '0.75')."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def trajectory_fraction(step_index: int, num_steps: int) -> float:
    """The step's fraction of the trajectory: 0 at the first (noisiest) step, 1 at the last."""
    return step_index / (num_steps - 1) if num_steps > 1 else 0.0


@dataclass(frozen=True)
class HeadActivationSchedule:
    """A head activation ratio per denoising step.

    ``spec``: the schedule as text (for a parsed or built-in schedule, text that
    :func:`parse_schedule` reads back as the same schedule; for a function, a description).
    ``rule(step_index, timestep, num_steps)`` gives the requested ratio; build schedules with
    the class methods or :func:`parse_schedule`. Two schedules are equal when their specs are.
    """

    spec: str
    rule: Callable[[int, int, int], Any] = field(compare=False, repr=False)
    num_steps: int | None = field(default=None, compare=False)  # per-step lists fix the step count
    parsed: bool = field(default=False, compare=False)  # spec reads back as this schedule

    def ratio_at(self, step_index: int, timestep: int | float, num_steps: int) -> float:
        """The ratio step ``step_index`` (of ``num_steps``, at ``timestep``) asks for.

        Raises InvalidInput naming the step when the rule gives something other than a real number."""
        value = self.rule(int(step_index), timestep, int(num_steps))
        if hasattr(value, "item") and not isinstance(value, numbers.Real):  # a one-element tensor or array
            try:
                value = value.item()
            except (ValueError, RuntimeError):
                pass
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InvalidInput(f"head-activation schedule {self.spec!r} gave {value!r} at step {step_index} "
                             f"(timestep {timestep:g}); it must give a number.")
        return float(value)

    def ratios(self, timesteps: Sequence[int | float]) -> list[float]:
        """The requested ratio of every step of a trajectory over ``timesteps`` (in order)."""
        steps = _timesteps(timesteps)
        if self.num_steps is not None and self.num_steps != len(steps):
            raise InvalidInput(f"the schedule has {self.num_steps} per-step ratios for {len(steps)} denoising steps; "
                               "give one ratio per step.")
        return [self.ratio_at(i, t, len(steps)) for i, t in enumerate(steps)]

    # ------------------------------------------------------------------ constructors
    @classmethod
    def constant(cls, ratio: float) -> "HeadActivationSchedule":
        """``ratio`` at every step (the same images as the float ``ratio``)."""
        value = _ratio(ratio, "constant")
        return cls(_fmt(value), lambda i, t, n: value, parsed=True)

    @classmethod
    def linear(cls, first: float, last: float) -> "HeadActivationSchedule":
        """``first`` at the first (noisiest) step to ``last`` at the last, linear in the step's fraction."""
        a, b = _ratio(first, "linear"), _ratio(last, "linear")
        return cls(f"linear:{_fmt(a)}:{_fmt(b)}", lambda i, t, n: a + (b - a) * trajectory_fraction(i, n), parsed=True)

    @classmethod
    def cosine(cls, first: float, last: float) -> "HeadActivationSchedule":
        """``first`` at the first step to ``last`` at the last along half a cosine: slow at both ends."""
        a, b = _ratio(first, "cosine"), _ratio(last, "cosine")

        def rule(i: int, t: int, n: int) -> float:
            return a + (b - a) * (1.0 - math.cos(math.pi * trajectory_fraction(i, n))) / 2.0

        return cls(f"cosine:{_fmt(a)}:{_fmt(b)}", rule, parsed=True)

    @classmethod
    def step(cls, pieces: Sequence[tuple[float, int]], otherwise: float) -> "HeadActivationSchedule":
        """``pieces`` of (ratio, T): the first piece with timestep > T gives the ratio; ``otherwise`` the rest."""
        pieces = [(_ratio(r, "step"), _threshold(threshold)) for r, threshold in pieces]
        last = _ratio(otherwise, "step")
        if not pieces:
            raise InvalidInput(f"a step schedule needs at least one R@t>T piece before its last ratio; "
                               f"{SCHEDULE_EXAMPLES}.")

        def rule(i: int, t: int, n: int) -> float:
            return next((r for r, threshold in pieces if t > threshold), last)

        spec = "step:" + ",".join(f"{_fmt(r)}@t>{threshold}" for r, threshold in pieces) + f",{_fmt(last)}"
        return cls(spec, rule, parsed=True)

    @classmethod
    def per_step(cls, ratios: Sequence[float]) -> "HeadActivationSchedule":
        """One ratio per denoising step, in order (the first is the noisiest step's)."""
        values = [float(r) for r in ratios]  # each step's range is checked against the model when planned
        if not values:
            raise InvalidInput("an empty list of per-step ratios; give one ratio per step.")
        spec = "per-step:" + ":".join(_fmt(v) for v in values)
        return cls(spec, lambda i, t, n: values[i], num_steps=len(values))

    @classmethod
    def of_timestep(cls, function: Callable[[int], float], name: str | None = None) -> "HeadActivationSchedule":
        """``function(timestep)`` at every step (timesteps count down from the noisiest)."""
        return cls(name or f"timestep-function:{getattr(function, '__name__', type(function).__name__)}",
                   lambda i, t, n: function(t))

    @classmethod
    def of_fraction(cls, function: Callable[[float], float], name: str | None = None) -> "HeadActivationSchedule":
        """``function(fraction)``, the step's fraction of the trajectory (0 first step, 1 last step)."""
        return cls(name or f"fraction-function:{getattr(function, '__name__', type(function).__name__)}",
                   lambda i, t, n: function(trajectory_fraction(i, n)))


def _timesteps(timesteps: Sequence[Any]) -> list[int | float]:
    """Timesteps as Python numbers: ints stay ints (DDPM, DDIM), fractional ones (Euler) floats."""
    values = timesteps.tolist() if hasattr(timesteps, "tolist") else [t.item() if hasattr(t, "item") else t
                                                                       for t in timesteps]
    return [int(t) if float(t).is_integer() else float(t) for t in values]


def _ratio(value: Any, kind: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not 0.0 < value <= 1.0:
        raise InvalidInput(f"a {kind} head-activation schedule's ratios must be numbers in (0, 1]; got {value!r}.")
    return float(value)


def _threshold(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InvalidInput(f"a step schedule's timestep thresholds must be ints >= 0; got {value!r}.")
    return int(value)


def is_schedule_spec(text: Any) -> bool:
    """Whether ``text`` names a schedule kind (``linear:``, ``cosine:``, ``step:``) rather than a number."""
    return isinstance(text, str) and text.strip().lower().split(":", 1)[0] in ("linear", "cosine", "step") \
        and ":" in text


def parse_schedule(text: str) -> HeadActivationSchedule:
    """A schedule from its text: a number, ``linear:A:B``, ``cosine:A:B`` or ``step:R1@t>T1[,R@t>T...],Rn``.

    Raises InvalidInput in one line naming what was wrong and giving examples."""
    if not isinstance(text, str):
        raise InvalidInput(f"a head-activation schedule spec must be text; got {type(text).__name__} ({SCHEDULE_EXAMPLES}).")
    spec = text.strip()
    kind, _, rest = spec.partition(":")
    kind = kind.strip().lower()

    def bad(why: str) -> InvalidInput:
        return InvalidInput(f"head-activation schedule {text!r}: {why}; {SCHEDULE_EXAMPLES}.")

    if not _:
        try:
            return HeadActivationSchedule.constant(float(spec))
        except ValueError:
            raise bad("neither a number nor a schedule (linear:, cosine:, step:)") from None
    if kind in ("linear", "cosine"):
        parts = rest.split(":")
        if len(parts) != 2:
            raise bad(f"{kind} takes two ratios, {kind}:FIRST:LAST")
        try:
            first, last = float(parts[0]), float(parts[1])
        except ValueError:
            raise bad(f"{kind}'s ratios must be numbers") from None
        try:
            return getattr(HeadActivationSchedule, kind)(first, last)
        except ValueError as err:
            raise bad(str(err).rstrip(".")) from None
    if kind == "step":
        items = [item for item in rest.split(",")]
        pieces = []
        for item in items[:-1]:
            match = _PIECE.fullmatch(item)
            if match is None:
                raise bad(f"{item.strip()!r} is not RATIO@t>TIMESTEP")
            pieces.append((float(match.group(1)), int(match.group(2))))
        try:
            last = float(items[-1])
        except ValueError:
            raise bad(f"a step schedule ends with the ratio for the remaining steps, not {items[-1].strip()!r}") from None
        try:
            return HeadActivationSchedule.step(pieces, last)
        except ValueError as err:
            raise bad(str(err).rstrip(".")) from None
    raise bad(f"unknown schedule kind {kind!r} (linear, cosine or step)")


def schedule_setting(value: Any) -> float | str:
    """A command line's or a settings file's ratio-or-schedule: a float for a plain number (what
    a float ratio always was), else the schedule's canonical spec (so equal schedules compare equal)."""
    if isinstance(value, str) and not is_schedule_spec(value):
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return parse_schedule(value).spec


def as_schedule(value: Any) -> HeadActivationSchedule:
    """``value`` as a schedule: a schedule, a spec string, a sequence of per-step ratios or a function
    of the timestep. Raises InvalidInput for anything else."""
    if isinstance(value, HeadActivationSchedule):
        return value
    if isinstance(value, str):
        return parse_schedule(value)
    if callable(value):
        return HeadActivationSchedule.of_timestep(value)
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value):
            raise InvalidInput("a list of per-step ratios must hold one number per denoising step.")
        return HeadActivationSchedule.per_step(value)
    raise InvalidInput(f"got {value!r}; give a number, a schedule ({SCHEDULE_EXAMPLES}), one ratio per step, or a "
                       "function of the timestep.")


def split_ratio_list(text: str) -> list[str]:
    """Split a comma-separated list of ratios and schedules, keeping a step schedule's own commas:
    ``"1.0,step:0.5@t>500,1.0,linear:0.5:1"`` -> ``["1.0", "step:0.5@t>500,1.0", "linear:0.5:1"]``.
    A step schedule takes every following item up to and including the first without ``@``."""
    items: list[str] = []
    open_step = False
    for item in text.split(","):
        if open_step:
            items[-1] += "," + item
            open_step = "@" in item
            continue
        items.append(item)
        open_step = item.strip().lower().startswith("step:") and "@" in item
    return items


@dataclass
class HeadActivationPlan:
    """What a schedule realises on a model over one trajectory, step by step.

    ``attention_flops``: per step, the ideal head-sparse attention FLOPs of one forward pass for
    one image at that step's top-K (:func:`moh_dit.models.flops.model_attention_flops`);
    ``dense_attention_flops``: the same with every head active.
    """

    spec: str
    timesteps: list[int | float]
    requested: list[float]
    realised: list[float]
    top_k: list[list[int]]
    attention_flops: list[int]
    dense_attention_flops: int

    @property
    def mean_ratio(self) -> float:
        return sum(self.realised) / len(self.realised)

    @property
    def mean_attention_flops(self) -> float:
        return sum(self.attention_flops) / len(self.attention_flops)

    @property
    def mean_attention_flop_ratio(self) -> float:
        return self.mean_attention_flops / self.dense_attention_flops

    @property
    def is_constant(self) -> bool:
        """Every step runs the same per-layer top-K (the images of that constant ratio)."""
        return all(k == self.top_k[0] for k in self.top_k)


def plan_head_activation(model: HeadActivated, schedule: HeadActivationSchedule, timesteps: Sequence[int]
                         ) -> HeadActivationPlan:
    """Resolve ``schedule`` on ``model`` for a trajectory over ``timesteps``, leaving the model as it was.

    Every step's ratio is checked before anything runs: an InvalidInput names the first step (and
    its timestep) whose ratio is not a number or lies outside the model's reachable range."""
    steps = _timesteps(timesteps)
    requested = schedule.ratios(steps)
    low, high = model.head_activation_range
    realised, top_k, flops = [], [], []
    dense = None
    for index, (ratio, t) in enumerate(zip(requested, steps)):
        if not math.isfinite(ratio) or not low - 1e-9 <= ratio <= high + 1e-9:
            raise InvalidInput(
                f"head-activation schedule {schedule.spec!r} asks for {ratio:.4f} at step {index} (timestep {t:g}), "
                f"outside this model's reachable range [{low:.4f}, {high:.4f}]; keep every step's ratio in that range."
            )
        value, k = preview_head_activation(model, ratio)
        sparse, dense = model_attention_flops(model, k)
        realised.append(value)
        top_k.append(list(k))
        flops.append(sparse)
    return HeadActivationPlan(schedule.spec, steps, requested, realised, top_k, flops, dense)
