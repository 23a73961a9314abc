"""MoH-DiT: Mixture-of-Head attention for Diffusion Transformers on diffusers."""

from .presets import PRESETS, get_preset, head_activation_ratio_of_config
from .transformer_moh_dit import (
    MoHAttention,
    MoHAttnProcessor,
    MoHDiTBlock,
    MoHDiTTransformer2DModel,
    MoHDiTTransformer2DModelOutput,
    MoHRouting,
    top_k_for_ratio,
)
from .pipelines.pipeline_moh_dit import MoHDiTPipeline, MoHDiTPipelineOutput
from .sparse_attention import MoHSparseAttnProcessor

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "get_preset",
    "head_activation_ratio_of_config",
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
