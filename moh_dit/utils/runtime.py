"""Process-wide torch settings the package switches, in one place."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["set_tf32", "tf32_disabled"]


def _switches():
    """The TF32 switches of this torch: torch >= 2.9 has per-backend ``fp32_precision`` settings
    and raises when they are mixed with the older ``allow_tf32`` flags, so those are used
    where they exist."""
    matmul, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    if hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision"):
        return (matmul, "fp32_precision", "tf32", "ieee"), (conv, "fp32_precision", "tf32", "ieee")
    return (matmul, "allow_tf32", True, False), (torch.backends.cudnn, "allow_tf32", True, False)


def set_tf32(enabled: bool) -> tuple:
    """Allow or forbid TF32 tensor-core math for float32 CUDA matmuls and convolutions.
    Returns the previous values, for :func:`tf32_disabled`-style restoring."""
    saved = []
    for owner, name, on, off in _switches():
        saved.append(getattr(owner, name))
        setattr(owner, name, on if enabled else off)
    return tuple(saved)


@contextlib.contextmanager
def tf32_disabled() -> Iterator[None]:
    """Run the block in full float32 (TF32 off), then restore the previous settings.

    TF32 keeps 10 mantissa bits; Inception features computed with it drift enough to move
    FID in the second decimal, so feature extraction runs inside this.
    """
    switches = _switches()
    saved = set_tf32(False)
    try:
        yield
    finally:
        for (owner, name, _, _), value in zip(switches, saved):
            setattr(owner, name, value)
