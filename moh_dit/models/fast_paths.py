"""Which computation a ``MoHAttention`` call runs, and the one-GEMM projection.

:func:`choose_path` is the one place that decides, per layer and per call, between the layer's
``processor`` (dense-masked ``MoHAttnProcessor`` by default), its ``sparse_processor``
(``MoHSparseAttnProcessor``, which skips the routed heads a token did not select) and the
default processor fed by :func:`fused_projections` (Q, K, V and the router linears as one
GEMM). All three give the same result to float rounding; the parameters and state-dict keys
are the layer's own either way. Measurements behind the defaults: docs/sparse_attention.md.

Works on anything with ``MoHAttention``'s attributes and imports only ``sparse_attention``
from the package, so the attention module can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .sparse_attention import skips_at_density

__all__ = ["SparseInferencePolicy", "choose_path", "fusable", "fused_projections"]


@dataclass(frozen=True)
class SparseInferencePolicy:
    """When automatic mode (``sparse_inference=None``) takes the head-sparse path: only
    where skipping heads pays for gathering the selected tokens.

    Args:
        max_active: largest fraction ``(hs + K) / h`` of a layer's heads that may be active.
        min_work: smallest ``tokens * inner_dim`` of a call. Below these two, gathering the
            selected tokens costs more than the skipped heads save.
        devices: device types the input may be on. On a GPU the GEMMs are so fast that
            launches, host syncs and gathers dominate, and dense-masked is faster.
    """

    max_active: float = 0.5
    min_work: int = 256 * 768
    devices: tuple[str, ...] = ("cpu",)

    def __post_init__(self):
        if not 0.0 <= self.max_active <= 1.0:
            raise ValueError(f"max_active={self.max_active} must be in [0, 1].")
        if self.min_work < 0:
            raise ValueError(f"min_work={self.min_work} must be >= 0.")
        if isinstance(self.devices, str) or not all(isinstance(d, str) for d in self.devices):
            raise ValueError(f"devices={self.devices!r} must be a tuple of device types such as ('cpu',).")
        object.__setattr__(self, "devices", tuple(self.devices))


def _skips_heads(attn: Any, tokens: int | None, device: torch.device | None, default_processor: bool) -> bool:
    if attn.training or attn.sparse_inference is False or not attn.num_routed_heads or not default_processor:
        return False
    if not (fusable(attn) and type(attn.to_out[0]) is torch.nn.Linear):  # it reads the raw weights
        return False
    dense_above = getattr(attn.sparse_processor, "dense_above", 1.0)
    if not skips_at_density(attn.top_k, attn.num_routed_heads, dense_above):
        return False
    if device is not None and torch.is_autocast_enabled(device.type):
        return False
    if attn.sparse_inference:
        return True
    policy = attn.sparse_policy
    active = (attn.num_shared_heads + attn.top_k) / attn.heads
    return (
        not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and active <= policy.max_active
        and (tokens or 0) * attn.inner_dim >= policy.min_work
        and (device is None or device.type in policy.devices)
    )


def choose_path(attn: Any, tokens: int | None = None, device: torch.device | None = None,
                default_processor: bool = True) -> str:
    """What a call of ``attn`` on ``tokens`` tokens on ``device`` runs: ``"sparse"``,
    ``"fused"`` or ``"default"``. ``default_processor``: the layer's processor is the default
    ``MoHAttnProcessor``; any other processor always runs itself (``"default"``), also with
    ``sparse_inference=True`` or ``fused_projections=True``.

    Head-sparse never in training mode, with ``sparse_inference=False``, another processor
    or without routed heads; nor when a projection it reads (``to_q``, ``to_k``, ``to_v``,
    ``to_out[0]``, the routers) is not a plain ``nn.Linear``: the sparse path reads their
    weights, so a LoRA layer (peft) or a user's module in their place would be ignored;
    never either when the routed density is above the sparse processor's ``dense_above`` or
    every routed head is selected (``skips_at_density``), or inside an autocast region on
    ``device`` (the projections would come out in another dtype than the input, and the
    sparse strategies' out= / in-place kernels would mix them). Then always with
    ``sparse_inference=True``, which in all the cases above takes the default path instead.
    In automatic mode (None) also only when autograd is off, the model is not being
    compiled (the sparse path has data-dependent shapes) and ``sparse_policy`` allows it.

    Otherwise fused when ``fused_projections`` says so (None: on CUDA, where one launch
    instead of four is what pays; elsewhere the separate linears, which keep CPU results
    bit-identical to the unfused layer), the default processor is in place and every
    projection is a plain ``nn.Linear`` (:func:`fusable`). ``device=None`` leaves out the
    conditions on the device.
    """
    if _skips_heads(attn, tokens, device, default_processor):
        return "sparse"
    on_cuda = device is not None and device.type == "cuda"
    fused = on_cuda if attn.fused_projections is None else attn.fused_projections
    return "fused" if fused and default_processor and fusable(attn) else "default"


def _fused_linears(attn: Any) -> list[torch.nn.Linear]:
    return [attn.to_q, attn.to_k, attn.to_v, *attn.routers().values()]


def fusable(attn: Any) -> bool:
    """Whether the projections of ``attn`` can run as one GEMM: all of them plain
    ``nn.Linear`` (a wrapped projection, e.g. a LoRA layer, must be called as a module)."""
    return all(type(m) is torch.nn.Linear for m in _fused_linears(attn))


def _fused_weight(attn: Any) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """(weight, bias, split sizes) of the fused GEMM: the rows of to_q, to_k, to_v and the
    routers stacked, bias zero for the bias-free routers. Concatenated per call when autograd
    records (the gradients reach each parameter through the concatenation); cached in no-grad
    inference until any weight changes (by its version counter)."""
    linears = _fused_linears(attn)
    sizes = [m.out_features for m in linears]
    cacheable = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    key = tuple((m.weight.data_ptr(), m.weight._version, None if m.bias is None else m.bias._version) for m in linears)
    cached = getattr(attn, "_fused_cache", None)
    if cacheable and cached is not None and cached[0] == key:
        return cached[1], cached[2], sizes
    weight = torch.cat([m.weight for m in linears])  # (3 h d + router rows, D)
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])
    if cacheable:
        attn._fused_cache = (key, weight, bias)  # a plain attribute: not in the state dict
    return weight, bias, sizes


def fused_projections(attn: Any, hidden_states: torch.Tensor):
    """Q, K, V (B, N, h d) and the router outputs ({name: (B, N, rows)}) of ``hidden_states``
    as one GEMM over the stacked weights, split after: one read of the input instead of up
    to six. Same values as the separate linears to float rounding."""
    weight, bias, sizes = _fused_weight(attn)
    q, k, v, *router_logits = F.linear(hidden_states, weight, bias).split(sizes, dim=-1)  # (B, N, rows) each
    return q, k, v, dict(zip(attn.routers(), router_logits))
