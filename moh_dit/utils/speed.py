"""Speed helpers for benchmarks/speed_report.py: the hardware's peak FLOP/s, training FLOPs.

MFU (model FLOPs utilisation) is the FLOPs a step needs divided by what the device could
do in that time. The step's FLOPs come from :mod:`moh_dit.models.flops` (training = 3 x forward:
the backward pass costs two forwards, one for the activations' gradients and one for the
weights'). The peak comes from :data:`GPU_PEAK_TFLOPS`, the vendors' dense (no sparsity)
tensor-core figures for a few GPUs by name, or, for any other device (the CPU included), from
a matmul timed on it (:func:`measure_matmul_flops`), which is a practical peak rather than a
datasheet one. :func:`peak_flops` says which of the two it used.

``compile_model`` is training's (:func:`moh_dit.training.compile_model`), named here for the
benchmarks and tests that import it from this module.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from ..models.flops import forward_flops
from ..training.trainer import GPU_PEAK_TFLOPS, compile_model

__all__ = ["GPU_PEAK_TFLOPS", "peak_flops", "measure_matmul_flops", "training_flops_per_image", "compile_model"]


def _precision_column(dtype: torch.dtype, allow_tf32: bool) -> int:
    if dtype in (torch.bfloat16, torch.float16):
        return 0
    return 1 if allow_tf32 else 2


def measure_matmul_flops(device: torch.device | str, dtype: torch.dtype = torch.float32, size: int | None = None,
                         repeats: int = 3) -> float:
    """FLOP/s of the best of ``repeats`` (size x size) @ (size x size) matmuls on ``device``
    (``size``: 1024 on the CPU, 8192 elsewhere), after one warm-up."""
    device = torch.device(device)
    size = size or (1024 if device.type == "cpu" else 8192)
    # A private generator: the timing must not consume the global random stream, which
    # training draws its noise and timesteps from (a fresh run would otherwise change).
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops(device: torch.device | str, dtype: torch.dtype = torch.float32,
               allow_tf32: bool = True) -> tuple[float, str]:
    """(peak FLOP/s, where it came from) of one ``device`` computing in ``dtype``.

    A CUDA GPU whose name holds a key of :data:`GPU_PEAK_TFLOPS` gets its datasheet figure
    (bf16/fp16; TF32 for float32 when ``allow_tf32``; else plain fp32); any other device
    gets a timed matmul in ``dtype`` (:func:`measure_matmul_flops`)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAK_TFLOPS.items():
            if key in name:
                column = _precision_column(dtype, allow_tf32)
                label = ("bf16/fp16", "tf32", "fp32")[column]
                return peaks[column] * 1e12, f"datasheet peak of {name}, {label} dense: {peaks[column]:g} TFLOP/s"
    measured = measure_matmul_flops(device, dtype)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return measured, f"measured matmul on {where} ({str(dtype).removeprefix('torch.')}): {measured / 1e9:.3g} GFLOP/s"


def training_flops_per_image(config_or_model: Mapping[str, Any] | Any) -> int:
    """FLOPs of one training step per image: 3 x the forward pass as the training path runs it
    (dense-masked: every head computed, ``ratio=1.0``; the routers included)."""
    return 3 * forward_flops(config_or_model, ratio=1.0)
