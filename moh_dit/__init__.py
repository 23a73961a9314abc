"""MoH-DiT: Mixture-of-Head attention for Diffusion Transformers, on diffusers.

    >>> from moh_dit import MoHDiTPipeline
    >>> pipe = MoHDiTPipeline.from_pretrained("runs/b2-75/final")
    >>> images = pipe([207, 360], head_activation_ratio=0.6).images

The names below are imported on first use, so ``import moh_dit`` (and the command line's
``--help``) loads no torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "MoHDiTTransformer2DModel": "models",
    "head_activation": "models",
    "PRESETS": "models.presets",
    "MoHDiTPipeline": "pipelines",
    "MoHDiTPipelineOutput": "pipelines",
    "load_pipeline": "sampling",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
