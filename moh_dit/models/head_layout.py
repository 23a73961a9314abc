"""Per-layer routed top-K for a head activation ratio: pure functions of a layer layout.

``MoHDiTTransformer2DModel.set_head_activation_ratio`` and ``moh_dit.models.flops`` (for config dicts,
without building a model) both use :func:`top_k_for_ratio`, so the rule lives here, apart
from the model; ``transformer_moh_dit`` re-exports both names. Imports nothing from the
package.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["min_top_k", "top_k_for_ratio"]


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
