"""Mixture-of-Head attention (MoH, Jin et al. 2025), read top to bottom.

Multi-head attention in summation form is ``out = sum_i H_i W_O^i``; MoH gives each token a
gate per head, ``out_t = sum_i g_{t,i} H_{t,i} W_O^i``. Heads ``0..hs-1`` of a layer are shared
(always on), heads ``hs..h-1`` routed, of which each token keeps its top-K. Reading order: the
routing result (:class:`MoHRouting`), the dense-masked computation (:class:`MoHAttnProcessor`:
every head by SDPA, the gates, the output projection) and :class:`MoHAttention`, whose
``route`` turns the router linears into gates.

Gate math follows the authors' MoH-DiT release (docs/design.md, section 1), which differs from
the paper's Eq. 5-6 by constant factors; ``gate_mode="paper"`` gives the equations as printed.
Faster computations of the same result are optional processors elsewhere: the head-sparse one
(``sparse_attention.py``) and the QKV + router projection as one GEMM (``fast_paths.py``, which
also decides, per call, which of them runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from torch import nn

from .fast_paths import SparseInferencePolicy, choose_path, fused_projections
from .sparse_attention import MoHSparseAttnProcessor

__all__ = ["GATE_MODES", "ROUTERS", "MoHRouting", "MoHAttnProcessor", "MoHAttention"]

GATE_MODES = ("release", "paper")
# The router linears of a MoH layer (release names wg_1, wg, wg_0), in the order their rows
# follow Q, K and V in the fused projection.
ROUTERS = ("router_shared", "router_routed", "router_mix")


@dataclass
class MoHRouting:
    """What the routers decided for one layer and one batch.

    ``gates`` is the dense per-head gate (zero for routed heads a token did not select);
    ``routed_index`` / ``routed_gates`` hold the routed decision in top-K form, which the
    head-sparse processor uses to skip work. The statistics are computed when read.
    """

    gates: torch.Tensor  # (B, N, h) float32
    routed_index: torch.Tensor | None = None  # (B, N, K) long, indices into the routed heads
    routed_gates: torch.Tensor | None = None  # (B, N, K) float32
    router_probs: torch.Tensor | None = None  # (B, N, E) float32, softmax of router_routed

    @property
    def routed_usage(self) -> torch.Tensor | None:
        """f_i, the fraction of tokens whose top-K holds routed head i: (E,), no gradient."""
        if self.router_probs is None:
            return None
        return torch.zeros_like(self.router_probs).scatter(-1, self.routed_index, 1.0).mean(dim=(0, 1))  # (E,)

    @property
    def load_balance_loss(self) -> torch.Tensor | None:
        """The release's ``E * sum_i P_i f_i`` with P_i the mean router probability (which
        carries the gradient); K at perfect balance (P_i = 1/E, f_i = K/E). None without
        routed heads."""
        if self.router_probs is None:
            return None
        return self.router_probs.shape[-1] * (self.router_probs.mean(dim=(0, 1)) * self.routed_usage).sum()

    @property
    def head_usage(self) -> torch.Tensor:
        """(h,) fraction of tokens that used each head (shared heads 1.0)."""
        heads = self.gates.shape[-1]
        routed = 0 if self.router_probs is None else self.router_probs.shape[-1]
        shared = self.gates.new_ones(heads - routed, dtype=torch.float32)
        return shared if self.router_probs is None else torch.cat([shared, self.routed_usage])


class MoHAttnProcessor:
    """Dense-masked MoH attention: every head is computed (SDPA), then each head's output is
    multiplied by its gate before the output projection (zero for unselected routed heads).

    The release's computation and the training path (routers get gradients through the
    gates). A dense layer (no routing) is plain multi-head attention. ``routing`` given
    (e.g. a fixed head mask) replaces the layer's own; ``fused`` takes Q, K, V and the router
    outputs from one GEMM (``fast_paths.fused_projections``; same values to float rounding).
    The routing is left on ``attn.routing``, where the block reads its statistics.
    """

    def __call__(self, attn: MoHAttention, hidden_states: torch.Tensor, routing: MoHRouting | None = None,
                 fused: bool = False) -> torch.Tensor:
        batch, tokens, _ = hidden_states.shape
        heads, head_dim = attn.heads, attn.inner_dim // attn.heads
        if fused:
            q, k, v, logits = fused_projections(attn, hidden_states)  # (B, N, h*d) x 3, {router: (B, N, rows)}
            routing = attn.route(hidden_states, logits) if routing is None else routing
        else:  # routers first: their order fixes how backward sums the input's gradient
            routing = attn.route(hidden_states) if routing is None else routing
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)  # (B, N, h*d)
        attn.routing = routing
        q = q.view(batch, tokens, heads, head_dim).transpose(1, 2)  # (B, h, N, d)
        k = k.view(batch, tokens, heads, head_dim).transpose(1, 2)  # (B, h, N, d)
        v = v.view(batch, tokens, heads, head_dim).transpose(1, 2)  # (B, h, N, d)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)  # (B, N, h, d)
        if routing is not None:
            out = out * routing.gates.unsqueeze(-1).to(out.dtype)  # (B, N, h, d)
        out = attn.to_out[0](out.reshape(batch, tokens, heads * head_dim))  # (B, N, D)
        return attn.to_out[1](out)  # (B, N, D), dropout


class MoHAttention(Attention):
    """diffusers ``Attention`` with Mixture-of-Head routers; ``forward`` returns the hidden
    states, like ``Attention``'s, and leaves the call's :class:`MoHRouting` on ``routing``.

    Router parameters live on this module, so they are saved with the model:

    =================  ===========  ================  ===================================
    attribute          release      shape             exists when
    =================  ===========  ================  ===================================
    ``router_routed``  ``wg``       (h - hs, D)       there are routed heads (h > hs)
    ``router_mix``     ``wg_0``     (2, D)            routed heads and hs > 0
    ``router_shared``  ``wg_1``     (hs, D)           hs > 1
    =================  ===========  ================  ===================================

    With ``num_shared_heads=None`` the layer is a plain dense attention (DiT baseline).
    ``inner_dim = heads * dim_head`` may differ from ``query_dim``. The faster paths and
    their switches (``sparse_inference``, ``sparse_policy``, ``sparse_processor``,
    ``fused_projections``) are described in ``fast_paths.choose_path``.

    Any diffusers processor can be set (``set_processor``, the model's ``set_attn_processor``);
    on a MoH layer it still computes MoH (``forward``). ``layer_name``: the layer's path in
    its model (the model sets it), named in errors.
    """

    _default_processor_cls = MoHAttnProcessor

    def __init__(self, query_dim: int, heads: int, dim_head: int, num_shared_heads: int | None = None,
                 top_k: int | None = None, gate_mode: str = "release", bias: bool = True, processor: Any | None = None):
        super().__init__(query_dim=query_dim, heads=heads, dim_head=dim_head, bias=bias, out_bias=True,
                         processor=processor if processor is not None else MoHAttnProcessor())
        if gate_mode not in GATE_MODES:
            raise ValueError(f"gate_mode={gate_mode!r}; choose one of {GATE_MODES}.")
        self.gate_mode = gate_mode
        self.is_moh = num_shared_heads is not None
        self.num_shared_heads = num_shared_heads if self.is_moh else heads
        self.num_routed_heads = heads - self.num_shared_heads
        self.trained_top_k = top_k if self.is_moh else 0
        self.top_k = self.trained_top_k
        routed, shared = self.num_routed_heads, self.num_shared_heads
        self.router_routed = nn.Linear(query_dim, routed, bias=False) if routed else None
        self.router_mix = nn.Linear(query_dim, 2, bias=False) if routed and shared > 0 else None
        self.router_shared = nn.Linear(query_dim, shared, bias=False) if self.is_moh and shared > 1 else None
        self.routing: MoHRouting | None = None  # the last call's; the block reads and clears it
        self.sparse_inference: bool | None = None
        self.sparse_policy = SparseInferencePolicy()
        self.sparse_processor = MoHSparseAttnProcessor()
        self.fused_projections: bool | None = None
        self.layer_name = type(self).__name__

    def routers(self) -> dict[str, nn.Linear]:
        """The router linears this layer has, by attribute name, in ``ROUTERS`` order."""
        return {name: getattr(self, name) for name in ROUTERS if getattr(self, name) is not None}

    def route(self, x: torch.Tensor, logits: dict[str, torch.Tensor] | None = None) -> MoHRouting | None:
        """Gates of every head for every token of ``x`` (B, N, D); None for a dense layer.

        Release gates: routed ``K * p_j / sum_topK p`` with ``p = softmax(W_r x)``; shared
        ``hs * softmax(W_s x)``; with both kinds, shared gates times ``a_0`` and routed times
        ``a_1`` where ``a = 2 * softmax(W_h x)``. A single shared head gets a constant gate of 1
        (the release crashes there). ``paper`` mode drops the K, hs and 2 factors and the top-K
        renormalisation. Softmaxes in float32. ``logits``: the routers' outputs if already
        computed (the fused projection), else the router linears run here.
        """
        if not self.is_moh:
            return None
        if logits is None:
            logits = {name: router(x) for name, router in self.routers().items()}  # (B, N, rows) each
        release, hs, k = self.gate_mode == "release", self.num_shared_heads, self.top_k
        parts = []
        if hs > 1:
            shared = logits["router_shared"].softmax(dim=-1, dtype=torch.float32)  # (B, N, hs)
            parts.append(shared * hs if release else shared)
        elif hs == 1:
            parts.append(x.new_ones(*x.shape[:2], 1, dtype=torch.float32))  # (B, N, 1)
        if not self.num_routed_heads:
            return MoHRouting(parts[0])
        probs = logits["router_routed"].softmax(dim=-1, dtype=torch.float32)  # (B, N, E)
        top_p, routed_index = probs.topk(k, dim=-1)  # (B, N, K)
        routed_gates = k * top_p / top_p.sum(dim=-1, keepdim=True) if release else top_p  # (B, N, K)
        if hs > 0:
            mix = logits["router_mix"].softmax(dim=-1, dtype=torch.float32)  # (B, N, 2)
            mix = mix * 2 if release else mix
            parts[0] = parts[0] * mix[..., :1]  # (B, N, hs)
            routed_gates = routed_gates * mix[..., 1:]  # (B, N, K)
        parts.append(torch.zeros_like(probs).scatter(-1, routed_index, routed_gates))  # (B, N, E)
        gates = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]  # (B, N, h)
        return MoHRouting(gates, routed_index, routed_gates, probs)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, N, D) -> (B, N, D). Runs ``processor`` (dense-masked by default), or one of the
        fast paths where ``fast_paths.choose_path`` picks it. Any other processor on a MoH
        layer runs with this layer's gates (``_with_gates``)."""
        self.routing = None
        path = self.path(hidden_states.shape[1], hidden_states.device)
        if path == "sparse":
            return self.sparse_processor(self, hidden_states)
        if path == "fused":
            return self.processor(self, hidden_states, fused=True)
        if self.is_moh and type(self.processor) is not MoHAttnProcessor:
            return self._with_gates(hidden_states)
        return self.processor(self, hidden_states)

    def _with_gates(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Run a processor that is not MoH's own, such as diffusers' ``AttnProcessor2_0``: the
        routing is computed here, and the gates multiply the heads where diffusers' processors
        hand them, (B, N, h*d), to ``to_out[0]`` (a pre-hook for this call). A processor that
        has left its own routing on ``routing`` by then (MoH's, wrapped by a user's) has
        gated the heads itself."""
        routing = self.route(hidden_states)
        gated = []

        def gate_heads(_to_out, args):
            if self.routing is not None:
                return None
            heads = args[0].unflatten(-1, (self.heads, -1))  # (B, N, h, d)
            gated.append(True)
            return ((heads * routing.gates.unsqueeze(-1).to(heads.dtype)).flatten(-2), *args[1:])  # (B, N, h*d)

        hook = self.to_out[0].register_forward_pre_hook(gate_heads)
        try:
            out = self.processor(self, hidden_states)
        finally:
            hook.remove()
        if self.routing is None:
            if not gated:
                raise ValueError(
                    f"{self.layer_name}: its processor {type(self.processor).__name__} never called to_out[0], "
                    "where a MoH layer gates its heads. Use a processor that passes the heads (B, N, heads * "
                    "head_dim) through attn.to_out[0], as diffusers' AttnProcessor2_0 and AttnProcessor do, or "
                    "MoHAttnProcessor."
                )
            self.routing = routing
        return out

    def path(self, tokens: int | None = None, device: torch.device | None = None) -> str:
        """``"sparse"``, ``"fused"`` or ``"default"``: what a call on ``tokens`` tokens on
        ``device`` runs (``fast_paths.choose_path``)."""
        return choose_path(self, tokens, device, default_processor=type(self.processor) is MoHAttnProcessor)

    def uses_sparse_processor(self, tokens: int | None = None, device: torch.device | None = None) -> bool:
        """Whether such a call skips heads (runs ``sparse_processor``)."""
        return self.path(tokens, device) == "sparse"
