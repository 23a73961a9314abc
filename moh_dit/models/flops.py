"""The package's one FLOP account of a MoH-DiT / DiT forward pass (docs/flops.md).

:func:`attention_flops` is one attention layer, dense or at the head-sparse ideal
(docs/design.md, section 4); :func:`forward_flop_terms` / :func:`forward_flops` are the whole
forward pass of any model config (a dict such as ``moh_dit.get_preset(...)``, or a model)
at any head activation ratio. A multiply-add counts as 2 FLOPs; only the matrix products
are counted (biases, norms, softmaxes, activations, gating and the einsum that unpatchifies
are not), which is what ``torch.utils.flop_counter.FlopCounterMode`` and the DiT paper's
GFLOPs (multiply-adds, so half these numbers) count.

The sweep's FLOP columns (``moh_dit.sampling.sweep``) and the attention benchmark's ideal
ratios are computed here. This module imports only ``layout`` and ``head_activation`` from the
package (no model code); a config dict is counted at any ratio with the model's top-K rule
(``HeadLayout.top_k_for_ratio``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Sequence

from .head_activation import preview_head_activation
from .layout import HeadLayout

__all__ = [
    "TIMESTEP_FEATURES",
    "attention_flops",
    "model_attention_flops",
    "forward_flop_terms",
    "forward_flops",
]

# DiT's sinusoidal timestep features, the input width of the timestep MLP.
TIMESTEP_FEATURES = 256
_REQUIRED = ("sample_size", "patch_size", "in_channels", "hidden_size", "num_layers", "num_attention_heads",
             "attention_head_dim")


def attention_flops(tokens: int, hidden: int, inner: int, ratio: float | Fraction | int = 1) -> int | float:
    """FLOPs of one attention layer for one image.

    ``tokens`` N, width ``hidden`` D, inner width ``inner`` D_in = h d, and ``ratio`` r the
    fraction of (token, head) pairs that compute. ``2 N D D_in (2 + 2r) + 4 r N^2 D_in``: the K
    and V projections always (any query may read any key), the Q and output projections and
    the attention core (scores and weighted sum) for the active pairs only; r = 1 is the dense
    layer, ``2 N D D_in * 4 + 4 N^2 D_in``. Routers, softmax and gating are not counted.

    An int or :class:`~fractions.Fraction` ratio (e.g. ``Fraction(active_heads, heads)``) is
    counted exactly and gives an int whenever ``r D_in`` is a whole number of channels; a
    float ratio gives a float.
    """
    if not 0 <= ratio <= 1:
        raise ValueError(f"ratio={ratio} must be in [0, 1] (the fraction of (token, head) pairs that compute).")
    exact = not isinstance(ratio, float)
    r = Fraction(ratio) if exact else ratio
    flops = 2 * tokens * hidden * inner * (2 + 2 * r) + 4 * r * tokens**2 * inner
    if not exact:
        return flops
    return int(flops) if flops.denominator == 1 else float(flops)


@dataclass(frozen=True)
class _Layout:
    """What the FLOPs depend on, read from a config dict or a model."""

    tokens: int
    hidden: int
    in_channels: int
    out_channels: int
    patch_size: int
    head_dim: int
    mlp_hidden: int
    head_layout: HeadLayout  # per layer: heads, shared heads (None: dense DiT), trained top-K
    current_top_k: list[int] | None

    @property
    def num_layers(self) -> int:
        return len(self.head_layout.heads)


def _layout(config_or_model: Mapping[str, Any] | Any) -> _Layout:
    model = None if isinstance(config_or_model, Mapping) else config_or_model
    config = dict(config_or_model if model is None else model.config)
    missing = [key for key in _REQUIRED if key not in config]
    if missing:
        raise ValueError(
            f"the config lacks {missing}; pass a MoHDiTTransformer2DModel config (e.g. get_preset(...)) or a model."
        )
    head_layout = HeadLayout.of_config(config)
    # The constructor's defaults, for config dicts that leave these out (presets do).
    out_channels = config.get("out_channels") or config["in_channels"] * (2 if config.get("learn_sigma", True) else 1)
    hidden = config["hidden_size"]
    return _Layout(
        tokens=(config["sample_size"] // config["patch_size"]) ** 2, hidden=hidden,
        in_channels=config["in_channels"], out_channels=out_channels, patch_size=config["patch_size"],
        head_dim=config["attention_head_dim"], mlp_hidden=int(hidden * config.get("mlp_ratio", 4.0)),
        head_layout=head_layout,
        current_top_k=None if not head_layout.is_moh else list(head_layout.top_k if model is None else model.top_k_per_layer),
    )


def _top_k_at(config_or_model: Mapping[str, Any] | Any, layout: _Layout, ratio: float | None) -> list[int] | None:
    """Per-layer top-K at head activation ``ratio`` (None: the model's current setting, or a
    config's trained one); None for a dense DiT."""
    if not layout.head_layout.is_moh:
        if ratio is not None and abs(ratio - 1.0) > 1e-9:
            raise ValueError(f"a dense DiT always runs at head activation ratio 1.0, not {ratio}.")
        return None
    if ratio is None:
        return layout.current_top_k
    if not isinstance(config_or_model, Mapping):
        return preview_head_activation(config_or_model, ratio)[1]  # the model's own allocation rule
    # The model's own allocation rule, from the layout alone (the model uses the same method).
    return layout.head_layout.top_k_for_ratio(float(ratio))


def _active_heads(layout: _Layout, top_k: Sequence[int] | None) -> list[int]:
    if not layout.head_layout.is_moh:
        return list(layout.head_layout.heads)
    if top_k is None:
        top_k = layout.current_top_k
    if len(top_k) != layout.num_layers:
        raise ValueError(f"top_k has {len(top_k)} entries for a {layout.num_layers}-layer model.")
    return [s + k for s, k in zip(layout.head_layout.shared, top_k)]


def model_attention_flops(
    config_or_model: Mapping[str, Any] | Any, top_k: Sequence[int] | None = None
) -> tuple[int, int]:
    """(head-sparse ideal, dense) attention FLOPs of all layers of one forward pass, one image.

    Layer l has ``hs_l + K_l`` active heads of ``h_l`` (every head for a dense DiT, whose
    ``top_k`` is ignored); ``top_k`` defaults to the model's current per-layer top-K (a
    config's trained one). Exact integers.
    """
    layout = _layout(config_or_model)
    sparse = dense = 0
    for heads, active in zip(layout.head_layout.heads, _active_heads(layout, top_k)):
        inner = heads * layout.head_dim
        sparse += attention_flops(layout.tokens, layout.hidden, inner, Fraction(active, heads))
        dense += attention_flops(layout.tokens, layout.hidden, inner)
    return sparse, dense


def _router_rows(heads: int, shared: int | None) -> int:
    """Output rows of a layer's router linears (docs/design.md, section 1): ``router_routed``
    (h - hs) when there are routed heads, ``router_mix`` (2) when there are both kinds,
    ``router_shared`` (hs) when hs > 1. They run for every token whatever the top-K."""
    if shared is None:
        return 0
    routed = heads - shared
    return routed + (2 if routed and shared > 0 else 0) + (shared if shared > 1 else 0)


def forward_flop_terms(
    config_or_model: Mapping[str, Any] | Any, ratio: float | None = None, batch: int = 1
) -> dict[str, int]:
    """The FLOPs of one forward pass of ``batch`` images, by part (docs/flops.md).

    ``ratio``: the head-weighted activation ratio, resolved to per-layer top-K by the model's
    rule (``HeadLayout.top_k_for_ratio``, which ``set_head_activation_ratio`` uses; a model
    is left as it was), for a model or a config dict alike; None: the model's
    current setting, or a config dict's trained layout. Each layer's attention is counted at
    its head-sparse ideal (:func:`attention_flops` at its active fraction ``(hs + K) / h``).
    Keys: ``patch_embedding``, ``timestep_embedding``, ``adaln_modulation`` (every block's and
    the final layer's), ``attention``, ``routers``, ``mlp``, ``final_layer``.
    """
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}.")
    layout = _layout(config_or_model)
    n, d = layout.tokens, layout.hidden
    sparse, _ = model_attention_flops(config_or_model, _top_k_at(config_or_model, layout, ratio))
    shared = layout.head_layout.shared or [None] * layout.num_layers
    per_image = {
        "patch_embedding": 2 * n * layout.in_channels * layout.patch_size**2 * d,  # a p x p, stride p conv
        "timestep_embedding": 2 * (TIMESTEP_FEATURES * d + d * d),  # once per image; the label is a lookup
        "adaln_modulation": 2 * d * 6 * d * layout.num_layers + 2 * d * 2 * d,  # from the (D,) conditioning
        "attention": sparse,
        "routers": sum(2 * n * d * _router_rows(h, s) for h, s in zip(layout.head_layout.heads, shared)),
        "mlp": 2 * 2 * n * d * layout.mlp_hidden * layout.num_layers,
        "final_layer": 2 * n * d * layout.patch_size**2 * layout.out_channels,
    }
    return {part: batch * flops for part, flops in per_image.items()}


def forward_flops(config_or_model: Mapping[str, Any] | Any, ratio: float | None = None, batch: int = 1) -> int:
    """Whole forward-pass FLOPs of ``batch`` images at head activation ``ratio`` (the sum of
    :func:`forward_flop_terms`). DiT-XL/2 at 256 px: 237,242,843,136 per image."""
    return sum(forward_flop_terms(config_or_model, ratio, batch).values())
