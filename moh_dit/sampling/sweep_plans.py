"""What a head-activation sweep runs: its ratios and schedules, resolved on the model, and their FLOPs.

A sweep's ``ratios`` list constant ratios (numbers in (0, 1], ``trained``, ``min``) and head-activation
schedules (``linear:0.5:1.0``, ``cosine:1.0:0.5``, ``step:0.5@t>500,1.0``;
:mod:`moh_dit.models.head_schedule`). :func:`plan_ratios` resolves each to a :class:`RatioPlan`:
the realised per-layer top-K of a constant ratio, or a schedule's per-step top-K and mean
attention FLOPs. Requests that run the same top-K at every step make the same images and
collapse into one plan. With ``match_flops`` every schedule is paired with the realisable
constant ratio whose attention FLOPs are closest to the schedule's mean (added when not
requested), so that the sweep compares the two at (nearly) equal cost; the FLOP difference that
remains is in the rows. FLOPs come from ``moh_dit.models.flops``, the package's one account.
``moh_dit.sampling.sweep`` re-exports everything here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Sequence

from ..errors import InvalidInput
from ..models import flops
from ..models.head_activation import preview_head_activation
from ..models.head_schedule import (HeadActivationPlan, SCHEDULE_EXAMPLES, is_schedule_spec, parse_schedule,
                                    plan_head_activation, split_ratio_list)
from ..models.transformer_moh_dit import MoHDiTTransformer2DModel

__all__ = [
    "DEFAULT_RATIOS",
    "RATIO_KEYWORDS",
    "RatioPlan",
    "attention_flops",
    "is_schedule",
    "layer_attention_flops",
    "parse_ratios",
    "plan_ratios",
    "transformer_calls_per_image",
]

RATIO_KEYWORDS = ("trained", "min")
_EXAMPLE = "ratios trained,1.0,0.75,min"  # the word ratios is the parameter (a command shows its flag)
DEFAULT_RATIOS: tuple[float | str, ...] = ("trained", 1.0, 0.9, 0.75, 0.6, "min")


def is_schedule(ratio: float | str) -> bool:
    """Whether an item of :func:`parse_ratios`' list is a schedule's spec (not a ratio or keyword)."""
    return isinstance(ratio, str) and ratio not in RATIO_KEYWORDS


def parse_ratios(text: str | Sequence[float | str]) -> list[float | str]:
    """``"trained,1.0,0.75,min,linear:0.5:1"`` (or a sequence) -> ``["trained", 1.0, 0.75, "min", "linear:0.5:1"]``.

    Schedules come back in their canonical spelling; a step schedule keeps its own commas
    (``step:0.5@t>500,1.0``, see :func:`~moh_dit.models.head_schedule.split_ratio_list`)."""
    items = split_ratio_list(text) if isinstance(text, str) else list(text)
    ratios: list[float | str] = []
    for item in items:
        if isinstance(item, str):
            item = item.strip()
            if not item:
                continue
            if item.lower() in RATIO_KEYWORDS:
                ratios.append(item.lower())
                continue
            if is_schedule_spec(item):
                ratios.append(parse_schedule(item).spec)  # one line naming what is wrong
                continue
            try:
                item = float(item)
            except ValueError:
                raise InvalidInput(
                    f"ratio {item!r} is neither a number, one of {RATIO_KEYWORDS}, nor a schedule "
                    f"({SCHEDULE_EXAMPLES}); e.g. {_EXAMPLE}", parameters="ratios",
                ) from None
        value = float(item)
        if not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise InvalidInput(f"head activation ratio {value} must be in (0, 1]; e.g. {_EXAMPLE}", parameters="ratios")
        ratios.append(value)
    if not ratios:
        raise InvalidInput(f"no ratios given ({text!r}); e.g. {_EXAMPLE}", parameters="ratios")
    return ratios


def _label(ratio: float | str) -> str:
    return ratio if isinstance(ratio, str) else str(float(ratio))


def layer_attention_flops(tokens: int, hidden: int, heads: int, head_dim: int, active_heads: int) -> tuple[int, int]:
    """(ideal head-sparse, dense) FLOPs of one attention layer for one image, exact integers:
    :func:`moh_dit.models.flops.attention_flops` at ``r = active_heads / heads`` and at ``r = 1``
    (docs/flops.md). Routers, softmax and gating are not counted.
    """
    if not 0 <= active_heads <= heads:
        raise ValueError(f"active_heads={active_heads} must be in [0, heads={heads}].")
    inner = heads * head_dim
    sparse = flops.attention_flops(tokens, hidden, inner, Fraction(active_heads, heads))
    return sparse, flops.attention_flops(tokens, hidden, inner)


def attention_flops(transformer: MoHDiTTransformer2DModel, top_k: Sequence[int] | None = None) -> tuple[int, int]:
    """(ideal head-sparse, dense) attention FLOPs of one forward pass for one image.

    Layer l has ``hs_l + K_l`` active heads of ``h_l`` (every head for a dense DiT); ``top_k``
    defaults to the model's current per-layer top-K (:func:`moh_dit.models.flops.model_attention_flops`).
    """
    return flops.model_attention_flops(transformer, top_k)


def transformer_calls_per_image(num_inference_steps: int, guidance_scale: float) -> int:
    """Forward passes per image: one per step, two with classifier-free guidance (the
    pipeline runs the unconditional half only when ``guidance_scale > 1``)."""
    return num_inference_steps * (2 if guidance_scale > 1.0 else 1)


@dataclass
class RatioPlan:
    """One row to be: the requested ratios (or schedules) that realise the same per-step top-K.

    A constant ratio has ``top_k_per_layer``; a schedule (``schedule`` set) runs the per-step
    top-K of its :class:`~moh_dit.models.head_schedule.HeadActivationPlan`, and
    ``realised_ratio`` is the mean of its realised per-step ratios. ``matched``: for a schedule
    planned with ``match_flops``, the constant plan with the closest attention FLOPs.
    """

    requested: list[str]
    realised_ratio: float
    top_k_per_layer: list[int]
    schedule: HeadActivationPlan | None = None
    matched: "RatioPlan | None" = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return "/".join(self.requested)

    @property
    def setting(self) -> float | str:
        """What the pipeline's ``head_activation_ratio`` gets: the realised ratio, or the schedule's spec."""
        return self.realised_ratio if self.schedule is None else self.schedule.spec

    def attention_flops(self, transformer: MoHDiTTransformer2DModel) -> tuple[int, int, int]:
        """(ideal head-sparse attention FLOPs summed over the steps, the dense sum, the number of
        steps it covers: 1 for a constant ratio) of one forward pass per step, one image."""
        if self.schedule is None:
            sparse, dense = attention_flops(transformer, self.top_k_per_layer)
            return sparse, dense, 1
        steps = len(self.schedule.attention_flops)
        return sum(self.schedule.attention_flops), self.schedule.dense_attention_flops * steps, steps

    def flop_ratio(self, transformer: MoHDiTTransformer2DModel) -> float:
        sparse, dense, _ = self.attention_flops(transformer)
        return sparse / dense


def _constant_value(transformer: MoHDiTTransformer2DModel, ratio: float | str) -> float:
    """The ratio a constant request stands for, checked against the model's range."""
    low, high = transformer.head_activation_range
    value = {"trained": transformer.trained_head_activation_ratio, "min": low}.get(ratio, ratio)
    value = float(value)
    if not transformer.is_moh and abs(value - 1.0) > 1e-9:
        raise InvalidInput(
            f"ratio {_label(ratio)} requested for a dense DiT: without routed heads its head activation ratio "
            "is always 1.0. Sweep a MoH-DiT model, or give ratios 1.0.", parameters="ratios",
        )
    if not low - 1e-9 <= value <= high + 1e-9:
        raise InvalidInput(
            f"ratio {_label(ratio)} is outside this model's reachable range [{low:.4f}, {high:.4f}] (shared heads "
            "are always active); give ratios in that range, or 'min' for the lowest. Nothing was sampled.",
            parameters="ratios",
        )
    return value


def plan_ratios(
    transformer: MoHDiTTransformer2DModel,
    ratios: Sequence[float | str],
    timesteps: Sequence[int] | None = None,
    match_flops: bool = False,
) -> list[RatioPlan]:
    """Validate ``ratios`` and resolve each to its realised ratio and per-layer (or per-step) top-K.

    ``"trained"`` is the trained layout, ``"min"`` the lowest reachable ratio; schedules need
    the sampling ``timesteps`` (``MoHDiTPipeline.sampling_timesteps``). Requests that realise
    the same top-K at every step (e.g. ``0.75`` and ``"trained"`` on a -75 model, or
    ``linear:0.75:0.75``) collapse into one plan. ``match_flops`` adds, for each schedule, the
    realisable constant ratio of closest attention FLOPs (:func:`_flop_matched_constant`). Plans
    are sorted by realised ratio, highest first, constants before schedules. The model is left
    as it was. Raises InvalidInput for a ratio or a schedule's step outside the reachable range
    (naming it) and for any ratio other than 1.0 on a dense DiT.
    """
    ratios = parse_ratios(ratios)
    plans: dict[tuple, RatioPlan] = {}

    def add(key: tuple, request: str, make) -> RatioPlan:
        if key not in plans:
            plans[key] = make()
        elif request not in plans[key].requested:
            plans[key].requested.append(request)
        return plans[key]

    for ratio in ratios:
        if is_schedule(ratio):
            if timesteps is None:
                raise InvalidInput(f"schedule {ratio} needs the sampling timesteps to be planned (pass timesteps).",
                                   parameters="timesteps")
            plan = plan_head_activation(transformer, parse_schedule(ratio), timesteps)
            if plan.is_constant:  # the images of a constant ratio
                add(tuple(plan.top_k[0]), ratio, lambda: RatioPlan([ratio], plan.realised[0], list(plan.top_k[0])))
            else:
                key = ("schedule",) + tuple(tuple(k) for k in plan.top_k)
                add(key, ratio, lambda: RatioPlan([ratio], plan.mean_ratio, [], schedule=plan))
            continue
        realised, top_k = preview_head_activation(transformer, _constant_value(transformer, ratio))
        add(tuple(top_k), _label(ratio), lambda: RatioPlan([_label(ratio)], realised, list(top_k)))
    if match_flops:
        for plan in [p for p in plans.values() if p.schedule is not None]:
            realised, top_k = _flop_matched_constant(transformer, plan)
            if tuple(top_k) not in plans:  # a requested constant keeps its own label
                plans[tuple(top_k)] = RatioPlan([f"{realised:.4g}"], realised, top_k)
            plan.matched = plans[tuple(top_k)]
    return sorted(plans.values(), key=lambda plan: (-plan.realised_ratio, plan.schedule is not None))


def _flop_matched_constant(transformer: MoHDiTTransformer2DModel, plan: RatioPlan) -> tuple[float, list[int]]:
    """(realised ratio, per-layer top-K) of the realisable constant ratio whose attention FLOPs
    are closest to the schedule's mean; of two equally close, the costlier (so that a schedule
    that wins does not win by having more compute)."""
    target = plan.attention_flops(transformer)[0] / len(plan.schedule.attention_flops)
    low, _ = transformer.head_activation_range
    total = sum(transformer.layer_heads)
    best = None
    for active in range(math.floor(low * total + 1e-9), total + 1):  # every realisable number of active heads
        realised, top_k = preview_head_activation(transformer, max(active / total, low))
        sparse = attention_flops(transformer, top_k)[0]
        candidate = (abs(sparse - target), -sparse, realised, list(top_k))
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return best[2], best[3]
