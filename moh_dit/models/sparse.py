"""Head-sparse MoH attention for inference: unselected routed heads cost nothing.

The dense-masked computation (``MoHAttnProcessor``) computes every head for every token and
multiplies unselected routed heads by a zero gate, as the authors' release does. This processor
computes the same result doing, per routed head, only the work of the tokens that selected it:

- shared heads (always on) stay dense: one SDPA on their slice of the projections;
- K and V are projected once for every head some token of the batch uses (a used head needs
  all keys and values: any token may attend to any other);
- for routed head j and image b, the tokens that selected j are gathered, projected to queries
  with j's slice of ``to_q``, attended against all N keys of (b, j), scaled by their gate,
  projected with j's slice of ``to_out`` and added into their output rows.

Per token, with r the fraction of active (token, head) pairs, that is ``2 D D_in (2 + 2r) +
4 r N D_in`` FLOPs instead of ``2 D D_in 4 + 4 N D_in``. The FLOPs go, not the bytes: each
selected pair gathers and scatters a D-wide row, so on a GPU this is not faster than the dense
path. Opt in with ``model.set_sparse_inference(True)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoHSparseAttnProcessor", "per_head_attention"]


def _plan(routing: Any, gates: torch.Tensor, shared: int):
    """Which token uses which routed head (one host sync). Tokens are grouped by (live routed
    head, image); slot c of a group holds the c-th token of that image that selected the head,
    groups padded to the largest, C, so that all live heads attend in one SDPA call. Unused
    slots read token 0 of their image with a zero gate."""
    batch, tokens, routed = gates.shape[0], gates.shape[1], gates.shape[2] - shared
    device = gates.device
    member = torch.zeros(batch, tokens, routed, dtype=torch.bool, device=device)
    member = member.scatter_(-1, routing.routed_index, True).permute(2, 0, 1)  # (E, B, N)
    counts = member.sum(-1)  # (E, B)
    counts_host = counts.tolist()  # the one host sync
    live = [j for j in range(routed) if any(counts_host[j])]
    live_t = torch.tensor(live, dtype=torch.long, device=device)
    member, counts = member[live_t], counts[live_t]  # (E', B, N), (E', B)
    head_ids = shared + live_t  # (E',)
    cap = max((max(counts_host[j]) for j in live), default=0)
    slot = torch.where(member, member.cumsum(-1) - 1, cap)  # (E', B, N)
    token_of_slot = torch.zeros(len(live), batch, cap + 1, dtype=torch.long, device=device)
    token_of_slot.scatter_(-1, slot, torch.arange(tokens, device=device).expand_as(slot))
    token_of_slot = token_of_slot[..., :cap]  # (E', B, C)
    in_use = (torch.arange(cap, device=device) < counts[..., None]).reshape(-1)  # (E'*B*C,)
    x_row = (token_of_slot + torch.arange(batch, device=device)[:, None] * tokens).reshape(-1)  # (E'*B*C,)
    slot_gate = gates[..., head_ids].permute(2, 0, 1).gather(-1, token_of_slot).reshape(-1)  # (E'*B*C,)
    slot_gate = (slot_gate * in_use).unsqueeze(1)  # (E'*B*C, 1)
    sizes = [sum(counts_host[j]) for j in live]  # tokens per live head, all images together
    return live, head_ids, cap, x_row, in_use, slot_gate, sizes


def per_head_attention(attn: Any, hidden_states: torch.Tensor, routing: Any) -> torch.Tensor:
    """(B, N, D) -> the output of ``MoHAttention`` ``attn`` before ``to_out``'s dropout, (B, N, D), for its
    ``MoHRouting``."""
    batch, tokens, dim = hidden_states.shape
    heads, shared = attn.heads, attn.num_shared_heads
    head_dim, rows = attn.inner_dim // heads, batch * tokens
    w_q, b_q, w_k, w_v, b_v = attn.to_q.weight, attn.to_q.bias, attn.to_k.weight, attn.to_v.weight, attn.to_v.bias
    w_out, b_out = attn.to_out[0].weight, attn.to_out[0].bias
    x = hidden_states.reshape(rows, dim)  # (B*N, D)
    gates = routing.gates.to(hidden_states.dtype)  # (B, N, h)
    live, head_ids, cap, x_row, in_use, slot_gate, sizes = _plan(routing, gates, shared)

    # No K and V biases: the K bias adds q . b_k to a whole row of scores, which softmax ignores,
    # and the V bias passes through attention unchanged (the weights sum to 1), so it is added to
    # the head outputs.
    kv_heads = torch.cat([torch.arange(shared, device=x.device), head_ids])  # (hs + E',)
    if len(kv_heads) < heads:
        w_k, w_v = (w.unflatten(0, (-1, head_dim))[kv_heads].flatten(0, 1) for w in (w_k, w_v))
    key = F.linear(x, w_k).view(batch, tokens, -1, head_dim)  # (B, N, hs + E', d)
    value = F.linear(x, w_v).view(batch, tokens, -1, head_dim)  # (B, N, hs + E', d)
    if shared:
        width = shared * head_dim
        q = F.linear(x, w_q[:width], None if b_q is None else b_q[:width])  # (B*N, hs*d)
        q = q.view(batch, tokens, shared, head_dim).transpose(1, 2)  # (B, hs, N, d)
        o = F.scaled_dot_product_attention(q, key[:, :, :shared].transpose(1, 2),
                                           value[:, :, :shared].transpose(1, 2)).transpose(1, 2)  # (B, N, hs, d)
        if b_v is not None:
            o = o + b_v.view(heads, head_dim)[:shared]  # (B, N, hs, d)
        out = F.linear((o * gates[..., :shared, None]).reshape(rows, width), w_out[:, :width], b_out)  # (B*N, D)
    else:
        out = x.new_zeros(rows, dim) if b_out is None else b_out.expand(rows, dim).clone()  # (B*N, D)
    if not live:
        return out.view(batch, tokens, dim)

    w_q, w_o = w_q.view(heads, head_dim, dim), w_out.view(dim, heads, head_dim)  # (h, d, D), (D, h, d)
    used = in_use.nonzero().squeeze(1)  # (P,) slots in use, by head, image, token
    used_rows = x_row[used]  # (P,)
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    parts = [(slice(bounds[p], bounds[p + 1]), shared + j) for p, j in enumerate(live)]
    q_used = torch.cat([
        F.linear(x.index_select(0, used_rows[part]), w_q[head],
                 None if b_q is None else b_q[head * head_dim:(head + 1) * head_dim])
        for part, head in parts])  # (P, d)
    q = x.new_zeros(len(in_use), head_dim).index_copy(0, used, q_used)  # (E'*B*C, d)
    o = F.scaled_dot_product_attention(q.view(len(live), batch, cap, head_dim),
                                       key[:, :, shared:].permute(2, 0, 1, 3),
                                       value[:, :, shared:].permute(2, 0, 1, 3))  # (E', B, C, d)
    if b_v is not None:
        o = o + b_v.view(heads, head_dim)[head_ids].view(len(live), 1, 1, head_dim)  # (E', B, C, d)
    o_used = (o.reshape(-1, head_dim) * slot_gate).index_select(0, used)  # (P, d)
    for part, head in parts:
        out.index_add_(0, used_rows[part], F.linear(o_used[part], w_o[:, head]))  # (B*N, D)
    return out.view(batch, tokens, dim)


class MoHSparseAttnProcessor:
    """Head-sparse MoH attention; the call and the result of ``MoHAttnProcessor`` (gradients too).

    Where there is nothing to skip (no routed heads, a top-K holding every routed head), inside an
    autocast region (the projections would change dtype), or when a projection is not a plain
    ``nn.Linear`` (a LoRA layer: this reads the raw weights), the layer's dense-masked processor runs.
    """

    computes_moh = True  # routes and gates itself, as MoHAttnProcessor does

    def __call__(self, attn: Any, hidden_states: torch.Tensor, routing: Any = None) -> torch.Tensor:
        plain = all(type(m) is nn.Linear for m in (attn.to_q, attn.to_k, attn.to_v, attn.to_out[0]))
        if (not attn.is_moh or attn.top_k >= attn.num_routed_heads or not plain
                or torch.is_autocast_enabled(hidden_states.device.type)):
            return attn._default_processor_cls()(attn, hidden_states, routing)
        routing = attn.route(hidden_states) if routing is None else routing
        attn.routing = routing
        return attn.to_out[1](per_head_attention(attn, hidden_states, routing))
