"""The per-layer head layout of a MoH-DiT / DiT, parsed and validated in one place.

:class:`HeadLayout` holds, per layer, the number of heads ``h``, of shared (always active) heads
``hs`` and the routed top-K ``K``; ``shared`` and ``top_k`` are None for a dense DiT. The
model, the presets, the FLOP count, upcycling and the model card all build it with
:meth:`HeadLayout.parse` / :meth:`HeadLayout.of_config`, so the rules a layout must obey are
written once. The head-weighted activation ratio ``sum (hs + K) / sum h`` and the rule that
picks a top-K per layer for another ratio (:func:`top_k_for_ratio`) are functions of it.
Imports nothing from the package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["HeadLayout", "min_top_k", "top_k_for_ratio"]


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
