"""The per-layer head layout of a MoH-DiT / DiT, parsed and validated in one place.

:class:`HeadLayout` holds, per layer, the number of heads ``h``, of shared (always active) heads
``hs`` and the routed top-K ``K``; ``shared`` and ``top_k`` are None for a dense DiT. The
model, the presets, the FLOP count, upcycling and the model card all build it with
:meth:`HeadLayout.parse` / :meth:`HeadLayout.of_config`, so the rules a layout must obey are
written once. The head-weighted activation ratio ``sum (hs + K) / sum h`` and the rule that
picks a top-K per layer for another ratio (:func:`top_k_for_ratio`) are functions of it, and
so is the rule that gives a dense layout a MoH layout for a ratio when it is upcycled
(:func:`upcycle_layout`, docs/upcycling.md). Imports nothing from the package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Sequence

from ..errors import InvalidInput

__all__ = ["HeadLayout", "min_top_k", "top_k_for_ratio", "upcycle_reachable_range", "upcycle_layout"]


def min_top_k(heads: int, shared: int) -> int:
    """The smallest routed top-K a layer may use: a layer without shared heads keeps one
    routed head so that it still attends; any other layer may drop to K = 0."""
    return 1 if shared == 0 and heads > shared else 0


def top_k_for_ratio(
    heads: Sequence[int], shared: Sequence[int], trained_top_k: Sequence[int], ratio: float
) -> list[int]:
    """Per-layer routed top-K that realises the head-weighted activation ``ratio``.

    The rule: the number of active heads is ``round(ratio * sum(h))`` (the closest any
    layout can get). Shared heads always stay on. Starting from the trained top-K, routed
    heads are added (ratio above the trained one) in proportion to each layer's unused
    routed heads, or removed (ratio below) in proportion to each layer's removable ones,
    with largest-remainder rounding (ties to the earlier layer). The trained ratio gives
    back exactly the trained top-K; a layer with no shared head keeps at least one routed
    head so that it still attends.
    """
    total = sum(heads)
    routed = [h - s for h, s in zip(heads, shared)]
    k_min = [min_top_k(h, s) for h, s in zip(heads, shared)]
    lowest = (sum(shared) + sum(k_min)) / total
    if not (lowest - 1e-9 <= ratio <= 1.0 + 1e-9):
        raise ValueError(
            f"head_activation_ratio={ratio} is outside the reachable range [{lowest:.4f}, 1.0] of this model "
            "(shared heads are always active; layers without shared heads keep one routed head)."
        )
    wanted = math.floor(ratio * total + 0.5) - sum(shared)
    wanted = min(max(wanted, sum(k_min)), sum(routed))
    base = list(trained_top_k)
    if wanted >= sum(base):
        room = [r - b for r, b in zip(routed, base)]
        change, sign = wanted - sum(base), 1
    else:
        room = [b - m for b, m in zip(base, k_min)]
        change, sign = sum(base) - wanted, -1
    if change == 0:
        return base
    capacity = sum(room)
    quotas = [change * r / capacity for r in room]
    alloc = [math.floor(q) for q in quotas]
    leftover = change - sum(alloc)
    order = sorted(range(len(room)), key=lambda i: (-(quotas[i] - alloc[i]), i))
    for i in order[:leftover]:
        alloc[i] += 1
    return [b + sign * a for b, a in zip(base, alloc)]


def upcycle_reachable_range(heads: Sequence[int]) -> tuple[float, float]:
    """(lowest, highest) head activation :func:`upcycle_layout` can give a dense model with
    ``heads`` per layer: one active head per layer (``len / sum``) up to every head (1.0)."""
    return len(heads) / sum(heads), 1.0


def _upcycle_drops(heads: Sequence[int], drop: int) -> list[int]:
    """How many heads each layer leaves inactive (``h - hs - K``), ``drop`` in all.

    The routed layers are the last ones: at least the last two thirds (the first
    ``layers // 3`` keep every head, as in the paper's XL and L layouts), more (from the back)
    when that is needed for no layer to leave more than half its heads inactive, and all of
    them beyond half when even that is not enough. Heads are dropped one at a time, in turn
    from the last routed layer backwards, skipping a layer at its limit: the drops differ by
    at most one between layers, and the later layers get the extra ones.
    """
    layers = len(heads)
    half = [h // 2 for h in heads]
    fits = [n for n in range(layers - layers // 3, layers + 1) if sum(half[layers - n:]) >= drop]
    routed, limit = (fits[0], half) if fits else (layers, [h - 1 for h in heads])
    order = [i for i in range(layers - 1, layers - routed - 1, -1) if limit[i] > 0]
    drops, left = [0] * layers, drop
    while left:  # the limits of ``order`` add up to at least ``drop``
        for i in order:
            if left and drops[i] < limit[i]:
                drops[i] += 1
                left -= 1
    return drops


def upcycle_layout(heads: Sequence[int], ratio: float) -> tuple[list[int], list[int]]:
    """Per-layer ``(shared, top_k)`` that turns a dense model with ``heads`` per layer into a MoH
    layout at the head activation nearest ``ratio`` (docs/upcycling.md, "Any ratio").

    Active heads ``A = round(ratio * sum h)`` (ties up, so the model never has fewer heads than
    asked for; ``ratio`` read as the decimal it prints as); every ``A`` from one head per layer
    to every head can be realised, so the realised ratio is within ``1 / (2 sum h)`` of
    ``ratio``. :func:`_upcycle_drops` says how many heads ``d`` each layer leaves inactive; a
    layer with ``d = 0`` keeps every head shared (``K = 0``), any other routes
    ``K = min(ceil(d / 2), h - d)`` of a routed pool of ``E = d + K`` heads (so ``K >= 1`` and
    ``E >= K + 1``: the router has a choice) and shares the other ``h - E``. Raises ValueError
    naming the reachable range (:func:`upcycle_reachable_range`) outside it.
    """
    heads = [int(h) for h in heads]
    if not heads or min(heads) < 1:
        raise ValueError(f"a dense layout needs at least one layer and one head per layer, got heads={heads}.")
    total = sum(heads)
    lowest, _ = upcycle_reachable_range(heads)
    if not lowest - 1e-9 <= ratio <= 1.0 + 1e-9:  # also refuses nan; the margin admits len / sum as a float
        raise InvalidInput(f"activation {ratio} is outside the reachable range [{lowest:.4f}, 1.0] of this dense "
                           f"model ({len(heads)} layers, {total} heads: at least one active head per layer, at most "
                           "all of them).", parameters="activation")
    active = math.floor(Fraction(repr(float(ratio))) * total + Fraction(1, 2))
    active = min(max(active, len(heads)), total)
    shared, top_k = [], []
    for h, d in zip(heads, _upcycle_drops(heads, total - active)):
        k = min((d + 1) // 2, h - d) if d else 0
        shared.append(h - d - k)
        top_k.append(k)
    return shared, top_k


def _per_layer(value: int | Sequence[int] | None, num_layers: int, name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (value,) * num_layers
    value = tuple(int(v) for v in value)
    if len(value) != num_layers:
        raise ValueError(f"{name} has {len(value)} entries but num_layers={num_layers}; give one per layer or an int.")
    return value


@dataclass(frozen=True)
class HeadLayout:
    """Heads, shared heads and routed top-K of every layer (``shared`` / ``top_k`` None: dense DiT).

    Build it with :meth:`parse` or :meth:`of_config`, which validate; the fields are tuples.
    """

    heads: tuple[int, ...]
    shared: tuple[int, ...] | None
    top_k: tuple[int, ...] | None

    @classmethod
    def parse(
        cls,
        num_layers: int,
        num_attention_heads: int | Sequence[int],
        num_shared_heads: int | Sequence[int] | None,
        top_k: int | Sequence[int] | None,
    ) -> "HeadLayout":
        """Expand per-layer settings (an int for every layer, or one value per layer) and
        validate them; raises ValueError naming the bad layer and value."""
        heads = _per_layer(num_attention_heads, num_layers, "num_attention_heads")
        shared = _per_layer(num_shared_heads, num_layers, "num_shared_heads")
        k = _per_layer(top_k, num_layers, "top_k")
        if (shared is None) != (k is None):
            raise ValueError(
                "num_shared_heads and top_k must be given together (MoH) or both be None (dense DiT); "
                f"got num_shared_heads={num_shared_heads!r}, top_k={top_k!r}."
            )
        for i, (h, hs, kk) in enumerate(zip(heads, shared or (), k or ())):
            routed = h - hs
            if not 0 <= hs <= h:
                raise ValueError(f"Layer {i}: num_shared_heads={hs} must be in [0, num_attention_heads={h}].")
            if not 0 <= kk <= routed:
                raise ValueError(f"Layer {i}: top_k={kk} must be in [0, routed heads={routed}] (h={h}, shared={hs}).")
            if routed > 0 and kk == 0:
                raise ValueError(
                    f"Layer {i}: {routed} routed heads but top_k=0, so they could never be used; "
                    "set top_k >= 1 or make every head shared."
                )
        return cls(heads, shared, k)

    @classmethod
    def of_config(cls, config: Mapping[str, Any]) -> "HeadLayout":
        """The layout of a ``MoHDiTTransformer2DModel`` config (a preset dict or ``model.config``)."""
        return cls.parse(config["num_layers"], config["num_attention_heads"], config.get("num_shared_heads"),
                         config.get("top_k"))

    @property
    def is_moh(self) -> bool:
        return self.shared is not None

    def activation_ratio(self, top_k: Sequence[int] | None = None) -> float:
        """Head-weighted activation ``sum (hs + K) / sum h`` at ``top_k`` (default: the
        layout's own); 1.0 for a dense DiT."""
        if self.shared is None:
            return 1.0
        return sum(s + k for s, k in zip(self.shared, self.top_k if top_k is None else top_k)) / sum(self.heads)

    def reachable_range(self) -> tuple[float, float]:
        """(lowest, highest) head-weighted ratio that :meth:`top_k_for_ratio` can realise."""
        if self.shared is None:
            return 1.0, 1.0
        lowest = sum(s + min_top_k(h, s) for h, s in zip(self.heads, self.shared))
        return lowest / sum(self.heads), 1.0

    def top_k_for_ratio(self, ratio: float) -> list[int]:
        """Per-layer top-K for head activation ``ratio`` by :func:`top_k_for_ratio`'s rule."""
        return top_k_for_ratio(self.heads, self.shared, self.top_k, ratio)
