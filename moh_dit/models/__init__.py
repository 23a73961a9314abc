"""The network: MoH attention, the MoH-DiT transformer, its head layouts and presets, FLOPs.

The network is a function of (noisy input, timestep, class) and knows nothing about noise
schedules (those are in :mod:`moh_dit.diffusion`).
"""

from .attention import MoHAttention
from .layout import HeadLayout
from .presets import PRESETS, get_preset, head_activation_ratio_of_config
from .transformer_moh_dit import MoHDiTBlock, MoHDiTTransformer2DModel, MoHDiTTransformer2DModelOutput

__all__ = ["PRESETS", "get_preset", "head_activation_ratio_of_config", "HeadLayout", "MoHAttention", "MoHDiTBlock",
           "MoHDiTTransformer2DModel", "MoHDiTTransformer2DModelOutput"]
