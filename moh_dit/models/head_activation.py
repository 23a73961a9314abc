"""Running a model at another head activation ratio for a while, and putting it back.

A MoH-DiT's routed top-K per layer is state on the model
(``MoHDiTTransformer2DModel.set_head_activation_ratio``). Whatever changes it for one job
(a pipeline call, a look at what a ratio would realise, a FLOP count) goes through
:func:`head_activation`, which gives the per-layer top-K back exactly as it found it, also
when the job raises.

This module works on anything with the model's head-activation interface
(:class:`HeadActivated`) and imports nothing from the package, so every other module
(the pipeline, sampling, ``flops``) can use it without an import cycle.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

__all__ = ["HeadActivated", "head_activation", "preview_head_activation"]


class HeadActivated(Protocol):
    """What :func:`head_activation` needs of a model (``MoHDiTTransformer2DModel`` has it)."""

    is_moh: bool
    top_k_per_layer: list[int]
    head_activation_ratio: float

    def set_head_activation_ratio(self, ratio: float | None, overrides: dict[int, int] | None = None) -> float: ...


@contextlib.contextmanager
def head_activation(model: HeadActivated, ratio: float | None) -> Iterator[float]:
    """Run the block with ``model`` at head activation ``ratio``; yields the realised ratio.

    ``ratio=None`` keeps the model's current setting. On exit, normal or by an exception, the
    per-layer top-K is restored exactly, including a non-trained one set before the block.
    An unreachable ratio raises the model's ValueError (naming its range) and changes nothing.
    """
    saved = model.top_k_per_layer
    try:
        yield model.set_head_activation_ratio(ratio) if ratio is not None else model.head_activation_ratio
    finally:
        if model.is_moh:  # a dense DiT has no routed top-K to put back
            model.set_head_activation_ratio(None, overrides=dict(enumerate(saved)))


def preview_head_activation(model: HeadActivated, ratio: float | None) -> tuple[float, list[int]]:
    """The realised ratio and per-layer top-K that ``ratio`` would give, leaving the model as
    it was. Raises ValueError (naming the reachable range) for an unreachable ratio."""
    with head_activation(model, ratio) as realised:
        return realised, model.top_k_per_layer
