"""FLOPs of a MoH-DiT / DiT forward pass, for the sweep's columns, the app and MFU.

A multiply-add counts as 2 FLOPs, and only matrix products count (not biases, norms, softmaxes,
gating), as ``torch.utils.flop_counter.FlopCounterMode`` counts; the DiT paper's GFLOPs are
multiply-adds, half these numbers. A model is counted at its current per-layer top-K, a config
dict (a preset) at its trained one, either at another head activation ratio by the model's rule.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Mapping, Sequence

from .transformer_moh_dit import HeadLayout

__all__ = ["attention_flops", "model_attention_flops", "forward_flops"]


def attention_flops(tokens: int, hidden: int, inner: int, ratio: float | Fraction | int = 1) -> int | float:
    """One attention layer for one image: ``2 N D D_in (2 + 2r) + 4 r N^2 D_in`` with ``N``
    tokens, width D, inner width D_in = h d and r the fraction of (token, head) pairs that
    compute. K and V are projected for every token (any query may read any key); Q, the core and
    the output projection only for active pairs. r = 1 is the dense layer. An int or Fraction
    ``ratio`` is counted exactly (an int when ``r D_in`` is whole); a float gives a float."""
    r = ratio if isinstance(ratio, float) else Fraction(ratio)
    flops = 2 * tokens * hidden * inner * (2 + 2 * r) + 4 * r * tokens**2 * inner
    if isinstance(flops, float):
        return flops
    return int(flops) if flops.denominator == 1 else float(flops)


def _config_and_top_k(config_or_model: Mapping[str, Any] | Any, top_k: Sequence[int] | None, ratio: float | None):
    model = None if isinstance(config_or_model, Mapping) else config_or_model
    config = {"out_channels": None, "learn_sigma": True, "mlp_ratio": 4.0,
              **(config_or_model if model is None else model.config)}
    layout = HeadLayout.of_config(config)
    if not layout.is_moh:
        return config, layout, list(layout.heads), list(layout.heads)
    if top_k is None:
        top_k = (layout.top_k if model is None else model.top_k_per_layer) if ratio is None else \
            layout.top_k_for_ratio(ratio)
    return config, layout, [s + k for s, k in zip(layout.shared, top_k)], list(layout.heads)


def model_attention_flops(config_or_model: Mapping[str, Any] | Any, top_k: Sequence[int] | None = None,
                          ratio: float | None = None) -> tuple[int, int]:
    """(head-sparse ideal, dense) attention FLOPs of all layers of one forward pass of one image,
    at per-layer ``top_k`` or head activation ``ratio`` (default: the current / trained one)."""
    config, layout, active, heads = _config_and_top_k(config_or_model, top_k, ratio)
    tokens = (config["sample_size"] // config["patch_size"]) ** 2
    sparse = dense = 0
    for h, a in zip(heads, active):
        inner = h * config["attention_head_dim"]
        sparse += attention_flops(tokens, config["hidden_size"], inner, Fraction(a, h))
        dense += attention_flops(tokens, config["hidden_size"], inner)
    return sparse, dense


def forward_flops(config_or_model: Mapping[str, Any] | Any, ratio: float | None = None, batch: int = 1) -> int:
    """Whole forward-pass FLOPs of ``batch`` images at head activation ``ratio``, attention at its
    head-sparse ideal. DiT-XL/2 at 256 px: 237,242,843,136 per image."""
    config, layout, _, heads = _config_and_top_k(config_or_model, None, ratio)
    n, d, p, layers = (config["sample_size"] // config["patch_size"]) ** 2, config["hidden_size"], \
        config["patch_size"], config["num_layers"]
    out_channels = config["out_channels"] or config["in_channels"] * (2 if config["learn_sigma"] else 1)
    routers = 0
    for h, s in zip(heads, layout.shared or [None] * layers):  # they run for every token at any top-K
        routers += 0 if s is None else (h - s) + (2 if h > s and s > 0 else 0) + (s if s > 1 else 0)
    per_image = (
        2 * n * config["in_channels"] * p * p * d  # patch embedding, a p x p convolution of stride p
        + 2 * (256 * d + d * d)  # timestep MLP from DiT's 256 sinusoidal features (the label is a lookup)
        + 2 * d * 6 * d * layers + 2 * d * 2 * d  # adaLN modulation of every block and the final layer
        + model_attention_flops(config_or_model, ratio=ratio)[0]
        + 2 * n * d * routers
        + 2 * 2 * n * d * int(d * config["mlp_ratio"]) * layers  # MLP
        + 2 * n * d * p * p * out_channels  # final layer
    )
    return batch * per_image
