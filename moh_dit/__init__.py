"""MoH-DiT: Mixture-of-Head attention for Diffusion Transformers on diffusers.

Subpackages by role: ``models`` (MoH attention, the transformer, presets, FLOPs),
``diffusion`` (noise schedules and losses), ``data`` (image folders, latent cache, the demo's
dataset), ``training``, ``sampling`` (sample folders at scale, the head-ratio sweep),
``evaluation`` (FID, sFID, IS, precision/recall, class accuracy), ``hub`` (conversion,
upcycling, export) and ``utils``; the pipeline is ``moh_dit.pipelines``.

The names below are imported when first used (PEP 562), so that ``import moh_dit`` and the
``moh-dit`` command's help do not pay for torch and diffusers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "PRESETS": "models.presets",
    "get_preset": "models.presets",
    "head_activation_ratio_of_config": "models.presets",
    "HeadLayout": "models.layout",
    "top_k_for_ratio": "models.layout",
    "MoHAttention": "models.attention",
    "MoHAttnProcessor": "models.attention",
    "MoHRouting": "models.attention",
    "MoHSparseAttnProcessor": "models.sparse_attention",
    "MoHDiTBlock": "models.transformer_moh_dit",
    "MoHDiTTransformer2DModel": "models.transformer_moh_dit",
    "MoHDiTTransformer2DModelOutput": "models.transformer_moh_dit",
    "MoHDiTPipeline": "pipelines.pipeline_moh_dit",
    "MoHDiTPipelineOutput": "pipelines.pipeline_moh_dit",
    "load_pipeline": "sampling.sample",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .models.attention import MoHAttention, MoHAttnProcessor, MoHRouting
    from .models.layout import HeadLayout, top_k_for_ratio
    from .models.presets import PRESETS, get_preset, head_activation_ratio_of_config
    from .models.sparse_attention import MoHSparseAttnProcessor
    from .models.transformer_moh_dit import MoHDiTBlock, MoHDiTTransformer2DModel, MoHDiTTransformer2DModelOutput
    from .pipelines.pipeline_moh_dit import MoHDiTPipeline, MoHDiTPipelineOutput
    from .sampling.sample import load_pipeline
