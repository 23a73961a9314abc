"""The network: MoH attention and the MoH-DiT transformer (one self-contained file), its presets,
the opt-in head-sparse processor and FLOP counts. The network is a function of (noisy input,
timestep, class) and knows nothing about noise schedules (:mod:`moh_dit.diffusion`).

Names are imported when first used, so that ``moh_dit.models.presets`` (``--preset`` choices)
loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PRESETS": "presets", "preset_names": "presets",
    "attention_flops": "flops", "model_attention_flops": "flops", "forward_flops": "flops",
    "MoHSparseAttnProcessor": "sparse",
    **dict.fromkeys(["HeadLayout", "top_k_for_ratio", "MoHRouting", "MoHAttnProcessor", "MoHAttention", "MoHDiTBlock",
                     "MoHDiTTransformer2DModel", "MoHDiTTransformer2DModelOutput", "head_activation"],
                    "transformer_moh_dit"),
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
