"""Speed helpers: the hardware's peak FLOP/s for MFU, training FLOPs, and torch.compile.

MFU (model FLOPs utilisation) is the FLOPs a step needs divided by what the device could
do in that time. The step's FLOPs come from :mod:`moh_dit.models.flops` (training = 3 x forward:
the backward pass costs two forwards, one for the activations' gradients and one for the
weights'). The peak comes from :data:`GPU_PEAK_TFLOPS`, the vendors' dense (no sparsity)
tensor-core figures for a few GPUs by name, or, for any other device (the CPU included), from
a matmul timed on it (:func:`measure_matmul_flops`), which is a practical peak rather than a
datasheet one. :func:`peak_flops` says which of the two it used.

Compilation (:func:`compile_model`) compiles a module in place with ``nn.Module.compile``, so
the module keeps its class, its attributes and its ``state_dict`` keys (no ``_orig_mod.``
prefix, unlike the wrapper ``torch.compile(module)`` returns): checkpoints, EMA updates,
``save_pretrained`` and the pipeline see the same model as before.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from ..models.flops import forward_flops

__all__ = ["GPU_PEAK_TFLOPS", "COMPILE_MODES", "peak_flops", "measure_matmul_flops", "training_flops_per_image",
           "compile_model"]

# Dense (no structured sparsity) peak TFLOP/s from the vendors' datasheets, by the first name
# fragment that torch.cuda.get_device_name() contains (more specific names first):
# (bf16/fp16 tensor cores with fp32 accumulation, TF32 tensor cores, plain fp32).
GPU_PEAK_TFLOPS: dict[str, tuple[float, float, float]] = {
    "H200": (989.4, 494.7, 66.9),
    "H100 PCIe": (756.0, 378.0, 51.2),
    "H100": (989.4, 494.7, 66.9),  # SXM
    "A100": (312.0, 156.0, 19.5),
    "L40S": (362.05, 183.0, 91.6),
    "RTX 4090": (165.2, 82.6, 82.6),
    "A10G": (70.0, 35.0, 31.2),
    "A10": (125.0, 62.5, 31.2),
}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


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


def compile_model(model: torch.nn.Module, mode: str | None = None, per_block: bool = False,
                  dynamic: bool | None = False) -> torch.nn.Module:
    """Compile ``model`` in place (``nn.Module.compile``) and return it.

    ``per_block``: compile each of ``model.transformer_blocks`` instead of the whole forward,
    which compiles one block's graph once and reuses it for blocks of the same shape (a
    fraction of the whole model's compile time; gradient checkpointing then wraps compiled
    blocks). ``mode``: one of :data:`COMPILE_MODES` or None (torch's default). ``dynamic``:
    False compiles for the shapes seen (a new batch size recompiles), None lets torch decide.
    The state-dict keys stay those of the uncompiled model.
    """
    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}; choose one of {', '.join(COMPILE_MODES)}.")
    kwargs = {"mode": mode, "dynamic": dynamic}
    if per_block:
        blocks = getattr(model, "transformer_blocks", None)
        if blocks is None:
            raise ValueError(f"per-block compilation needs a model with transformer_blocks; {type(model).__name__} "
                             "has none.")
        for block in blocks:
            block.compile(**kwargs)
    else:
        model.compile(**kwargs)
    return model
