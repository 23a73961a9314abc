"""MoH routing: the gates from the routers' outputs, and the dense-masked layer with its
QKV projection and router linears fused into one GEMM.

``MoHAttention.route`` (three router linears, then :func:`route_from_logits`) and
:func:`fused_dense_masked_attention` (one GEMM over the stacked weights of ``to_q``,
``to_k``, ``to_v`` and the routers, split after, then the same :func:`route_from_logits`)
share the gate arithmetic, so the two paths differ only by the GEMM's float rounding.
The parameters stay the separate linears', so the state dict (and the release checkpoint's
conversion) is unchanged. This module imports only ``sparse_attention`` from the package.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .sparse_attention import MoHRouting, attend

__all__ = ["ROUTERS", "route_from_logits", "fusable", "fused_dense_masked_attention"]

# The router linears of a MoH layer, in the order their rows follow QKV in the fused GEMM.
ROUTERS = ("router_shared", "router_routed", "router_mix")


def route_from_logits(attn: Any, x: torch.Tensor, logits: dict[str, torch.Tensor], need_stats: bool) -> MoHRouting:
    """The gates of ``MoHAttention.route`` from its routers' outputs ``logits`` (by attribute
    name, (B, N, rows) each), however they were computed: by the three router linears, or
    split off the fused QKV + router GEMM. ``x`` (B, N, D) gives the shape and device.

    Release gates (docs/design.md, section 1); ``attn.gate_mode == "paper"`` drops the K, hs
    and 2 factors and the top-K renormalisation. Softmaxes in float32. The load-balance
    loss and head usage only with ``need_stats``."""
    release = attn.gate_mode == "release"
    batch, tokens, _ = x.shape
    hs, routed = attn.num_shared_heads, attn.num_routed_heads
    parts = []
    if hs > 1:
        shared = logits["router_shared"].softmax(dim=-1, dtype=torch.float32)  # (B, N, hs)
        parts.append(shared * hs if release else shared)
    elif hs == 1:
        parts.append(x.new_ones(batch, tokens, 1, dtype=torch.float32))
    routed_index = routed_gates = lb_loss = usage_routed = None
    if routed:
        k = attn.top_k
        probs = logits["router_routed"].softmax(dim=-1, dtype=torch.float32)  # (B, N, E)
        top_p, routed_index = probs.topk(k, dim=-1)  # (B, N, K)
        routed_gates = k * top_p / top_p.sum(dim=-1, keepdim=True) if release else top_p
        if hs > 0:
            mix = logits["router_mix"].softmax(dim=-1, dtype=torch.float32)  # (B, N, 2)
            if release:
                mix = mix * 2
            parts[0] = parts[0] * mix[..., :1]
            routed_gates = routed_gates * mix[..., 1:]
        parts.append(torch.zeros_like(probs).scatter(-1, routed_index, routed_gates))  # (B, N, E)
        if need_stats:
            # f_i: fraction of tokens whose top-K holds routed head i (no gradient);
            # P_i: mean router probability (carries the gradient). l = E * sum_i P_i f_i.
            selected = torch.zeros_like(probs).scatter(-1, routed_index, 1.0)
            usage_routed = selected.mean(dim=(0, 1))  # (E,)
            lb_loss = routed * (probs.mean(dim=(0, 1)) * usage_routed).sum()
    gates = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]  # (B, N, h)
    usage = None
    if need_stats:
        shared_usage = x.new_ones(hs, dtype=torch.float32)
        usage = shared_usage if usage_routed is None else torch.cat([shared_usage, usage_routed])
    return MoHRouting(gates, routed_index, routed_gates, lb_loss, usage)


def _fused_linears(attn: Any) -> list[torch.nn.Linear]:
    return [attn.to_q, attn.to_k, attn.to_v] + [getattr(attn, n) for n in ROUTERS if getattr(attn, n, None) is not None]


def fusable(attn: Any) -> bool:
    """Whether the projections of ``attn`` can run as one GEMM: all of them plain
    ``nn.Linear`` (a wrapped projection, e.g. a LoRA layer, must be called as a module)."""
    return all(type(m) is torch.nn.Linear for m in _fused_linears(attn))


def _fused_weight(attn: Any) -> tuple[torch.Tensor, torch.Tensor | None, list[int], list[str]]:
    """(weight, bias, split sizes, router names) of the fused GEMM: the rows of to_q, to_k,
    to_v and the routers stacked, bias zero for the bias-free routers. Concatenated per call
    when autograd records (the gradients reach each parameter through the concatenation);
    cached in no-grad inference until any weight changes (by its version counter)."""
    linears = _fused_linears(attn)
    names = [n for n in ROUTERS if getattr(attn, n, None) is not None]
    sizes = [m.out_features for m in linears]
    cacheable = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    key = tuple((m.weight.data_ptr(), m.weight._version, None if m.bias is None else m.bias._version) for m in linears)
    cached = getattr(attn, "_fused_cache", None)
    if cacheable and cached is not None and cached[0] == key:
        return cached[1], cached[2], sizes, names
    weight = torch.cat([m.weight for m in linears])  # (3 h d + router rows, D)
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])
    if cacheable:
        attn._fused_cache = (key, weight, bias)  # a plain attribute: not in the state dict
    return weight, bias, sizes, names


def fused_dense_masked_attention(attn: Any, hidden_states: torch.Tensor,
                                 need_stats: bool = False) -> tuple[torch.Tensor, MoHRouting | None]:
    """:func:`dense_masked_attention` with ``attn.route``'s routing, the Q, K, V projections and
    the router linears computed as one GEMM over the stacked weights and split after (one
    read of the input instead of up to six). Same output and gradients to float rounding;
    the parameters and state-dict keys are the separate linears' own. Returns (output, routing)."""
    batch, tokens, _ = hidden_states.shape
    weight, bias, sizes, names = _fused_weight(attn)
    q, k, v, *router_logits = F.linear(hidden_states, weight, bias).split(sizes, dim=-1)  # (B, N, rows) each
    routing = route_from_logits(attn, hidden_states, dict(zip(names, router_logits)), need_stats) if attn.is_moh else None
    return attend(attn, q, k, v, routing, batch, tokens), routing
