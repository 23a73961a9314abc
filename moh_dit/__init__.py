"""MoH-DiT: Mixture-of-Head attention for Diffusion Transformers on diffusers.

Subpackages by role: ``models`` (MoH attention, the transformer, presets, FLOPs),
``diffusion`` (noise schedules and losses), ``data`` (image folders, latent cache, the demo's
dataset), ``training``, ``sampling`` (sample folders at scale, the head-ratio sweep),
``evaluation`` (FID, sFID, IS, precision/recall, class accuracy), ``hub`` (conversion,
upcycling, export) and ``utils``; the pipeline is ``moh_dit.pipelines``.
"""

from . import _compat
from .models.attention import MoHAttention, MoHAttnProcessor, MoHRouting
from .models.layout import HeadLayout, top_k_for_ratio
from .models.presets import PRESETS, get_preset, head_activation_ratio_of_config
from .models.sparse_attention import MoHSparseAttnProcessor
from .models.transformer_moh_dit import MoHDiTBlock, MoHDiTTransformer2DModel, MoHDiTTransformer2DModelOutput
from .pipelines.pipeline_moh_dit import MoHDiTPipeline, MoHDiTPipelineOutput

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "get_preset",
    "head_activation_ratio_of_config",
    "HeadLayout",
    "MoHAttention",
    "MoHAttnProcessor",
    "MoHDiTBlock",
    "MoHDiTTransformer2DModel",
    "MoHDiTTransformer2DModelOutput",
    "MoHRouting",
    "top_k_for_ratio",
    "MoHDiTPipeline",
    "MoHDiTPipelineOutput",
    "MoHSparseAttnProcessor",
]

_compat.install()


def __getattr__(name: str):
    """``moh_dit.presets`` and the other old module names, as attributes (deprecated)."""
    if name in _compat.MOVED:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
