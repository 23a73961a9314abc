"""What the benchmark tools share: the device choice, random weights, diffusers' DiT built from a
preset, and interleaved timing.

The tools import this as a sibling module (``import common``): ``python benchmarks/X.py`` puts
the script's folder first on ``sys.path``.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from diffusers import DiTTransformer2DModel

from moh_dit.models.presets import PRESETS

__all__ = ["diffusers_dit", "interleaved_medians", "interleaved_times", "pick_device", "randomize_weights_", "sync"]


def pick_device(name: str | None) -> torch.device:
    """``name``, or CUDA if there is one, else the CPU."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def randomize_weights_(model: torch.nn.Module, std: float = 0.02) -> torch.nn.Module:
    """Every parameter drawn from N(0, std), in place. DiT's init zeroes the adaLN and output
    layers, which would let whole blocks short-circuit; speed and the conversion's differences
    do not depend on the values otherwise."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=std)
    return model


def diffusers_dit(preset: str) -> DiTTransformer2DModel:
    """diffusers' ``DiTTransformer2DModel`` with the shape of a dense package preset."""
    cfg = PRESETS[preset]
    return DiTTransformer2DModel(
        num_attention_heads=cfg["num_attention_heads"], attention_head_dim=cfg["attention_head_dim"],
        in_channels=cfg["in_channels"], out_channels=2 * cfg["in_channels"], num_layers=cfg["num_layers"],
        sample_size=cfg["sample_size"], patch_size=cfg["patch_size"], num_embeds_ada_norm=cfg["num_classes"],
    )


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer measures it (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_times(
    fns: dict[str, Callable[[], object]], repeats: int, device: torch.device, warmup: int = 1, alternate: bool = True,
) -> dict[str, list[float]]:
    """Seconds of each call of each function, calling them round-robin ``repeats`` times after
    ``warmup`` calls of each. One call of every function per round, so that a machine whose
    speed drifts slows all of them alike; with ``alternate`` the order is reversed every
    other round, so that no function always runs right after the same one."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats):
        order = list(fns.items())[:: -1 if alternate and round_ % 2 else 1]
        for name, fn in order:
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, device: torch.device, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function, from :func:`interleaved_times` (order alternating)."""
    times = interleaved_times(fns, repeats, device, warmup)
    return {name: statistics.median(ts) for name, ts in times.items()}
