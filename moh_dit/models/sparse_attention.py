"""Head-sparse MoH attention for inference: unselected routed heads cost nothing.

The dense-masked computation (``MoHAttnProcessor`` in ``attention.py``) computes every head for
every token and multiplies unselected routed heads by a zero gate, as the authors' release
does, so MoH saves no compute there. ``MoHSparseAttnProcessor`` computes the same result
while doing, per routed head, only the work of the tokens that selected it:

- shared heads (always on) stay dense: one SDPA on their slice of the projections;
- K and V are projected once for every head that some token of the batch uses (all keys
  and values of a used head are needed: any token may attend to any other);
- for routed head j and image b, the tokens that selected j are gathered, projected to
  queries with j's slice of ``to_q``, attended against all N keys of (b, j), scaled by their
  gate, projected with j's slice of ``to_out`` and added into their output rows.

Per-token FLOPs (docs/design.md, section 4), with r the fraction of active (token, head)
pairs: dense ``2 D D_in * 4 + 4 N D_in``, head-sparse ideal ``2 D D_in (2 + 2r) + 4 r N D_in``.
The FLOPs go, but not the bytes: each selected (token, head) pair gathers a D-wide input row
and adds back a D-wide output row, so the layer moves about as much memory as the dense one
(docs/sparse_attention.md has the measured times).

This module only computes. Whether a layer skips heads at all is decided in one place,
``fast_paths.choose_path``; nothing here imports the attention module or the model. Reading
order: the density rule, the weights and the selection plan, the computation
(``per_head_attention``), the processor, the block helpers.

Only portable torch operations are used (index_select, addmm, scaled_dot_product_attention,
index_add_), so the same code runs on CPU and CUDA. One computation is kept: on a GPU no
head-sparse variant measured (padded bmm, or jagged nested-tensor SDPA without a host sync)
beat dense-masked attention, so automatic mode never chooses this path there
(docs/sparse_attention.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F


__all__ = [
    "Routing",
    "skips_at_density",
    "Projections",
    "SelectionPlan",
    "per_head_attention",
    "MoHSparseAttnProcessor",
]

# Size of one block of rows of the Q and output projections; the block buffer is reused, so no
# large buffer is allocated per call. Large rather than cache-sized: when other processes
# share the cores every extra call can wait for a busy core (docs/sparse_attention.md).
DEFAULT_BLOCK_BYTES = 8 << 20


class Routing(Protocol):
    """What the head-sparse computation reads of a layer's ``MoHRouting`` (``attention.py``)."""

    gates: torch.Tensor  # (B, N, h) float32, zero for routed heads a token did not select
    routed_index: torch.Tensor | None  # (B, N, K) long, indices into the routed heads
    routed_gates: torch.Tensor | None  # (B, N, K) float32


# --------------------------------------------------------------------------------------
# The density rule, the weights and the selection plan
# --------------------------------------------------------------------------------------


def skips_at_density(top_k: int, routed: int, dense_above: float) -> bool:
    """The density rule: a layer skips heads only if it has routed heads, its tokens leave
    some unselected (``top_k < routed``) and at most ``dense_above`` of them are selected;
    above that, gathering and scattering the selected tokens costs more than it saves."""
    return bool(routed) and top_k < routed and top_k <= dense_above * routed


@dataclass(frozen=True)
class Projections:
    """The weights of one MoH attention layer, in ``nn.Linear`` layout (out, in).

    Heads ``0 .. shared-1`` are the shared ones, the rest routed (docs/design.md, section 1).
    """

    w_q: torch.Tensor  # (h*d, D)
    b_q: torch.Tensor | None  # (h*d,)
    w_k: torch.Tensor  # (h*d, D)
    b_k: torch.Tensor | None
    w_v: torch.Tensor  # (h*d, D)
    b_v: torch.Tensor | None
    w_out: torch.Tensor  # (D, h*d)
    b_out: torch.Tensor | None  # (D,)
    heads: int
    shared: int

    @property
    def head_dim(self) -> int:
        return self.w_q.shape[0] // self.heads

    @classmethod
    def of(cls, attn: Any) -> "Projections":
        """The weights of a ``MoHAttention`` (read, not copied)."""
        return cls(
            attn.to_q.weight, attn.to_q.bias, attn.to_k.weight, attn.to_k.bias, attn.to_v.weight, attn.to_v.bias,
            attn.to_out[0].weight, attn.to_out[0].bias, attn.heads, attn.num_shared_heads,
        )


@dataclass(frozen=True)
class SelectionPlan:
    """Which token uses which routed head, computed once per call (one host sync).

    Tokens are grouped by (live routed head, image). Slot c of a group holds the c-th token
    of that image that selected the head; groups are padded to the largest one, C, so that
    the attention of all live heads is one SDPA call. Unused slots read token 0 of their
    image with a zero gate and are left out of the projections.
    """

    batch: int
    tokens: int
    live: list[int]  # routed heads (0 .. E-1) some token selected, E' of them
    head_ids: torch.Tensor  # (E',) their head ids, shared + live
    sizes: list[int]  # tokens that selected each live head, all images together
    cap: int  # C, the largest (head, image) group
    x_row: torch.Tensor  # (E'*B*C,) row of the flattened input each slot reads
    in_use: torch.Tensor  # (E'*B*C,) bool, slot holds a token
    slot_gate: torch.Tensor  # (E'*B*C, 1) the token's gate for the head, zero in unused slots

    @property
    def rows(self) -> int:
        return self.batch * self.tokens

    @classmethod
    def of(cls, routing: Routing, gates: torch.Tensor, shared: int) -> "SelectionPlan":
        """Plan from the top-K decision; ``gates`` is ``routing.gates`` in the compute dtype."""
        batch, tokens, routed = gates.shape[0], gates.shape[1], gates.shape[2] - shared
        device = gates.device
        member = torch.zeros(batch, tokens, routed, dtype=torch.bool, device=device)
        member = member.scatter_(-1, routing.routed_index, True).permute(2, 0, 1)  # (E, B, N)
        counts = member.sum(-1)  # (E, B)
        counts_host = counts.tolist()  # the one host sync
        live = [j for j in range(routed) if any(counts_host[j])]
        live_t = torch.tensor(live, dtype=torch.long, device=device)
        member, counts = member[live_t], counts[live_t]  # (E', B, N), (E', B)
        head_ids = shared + live_t
        cap = max((max(counts_host[j]) for j in live), default=0)
        slot = torch.where(member, member.cumsum(-1) - 1, cap)  # (E', B, N)
        token_of_slot = torch.zeros(len(live), batch, cap + 1, dtype=torch.long, device=device)
        token_of_slot.scatter_(-1, slot, torch.arange(tokens, device=device).expand_as(slot))
        token_of_slot = token_of_slot[..., :cap]  # (E', B, C)
        in_use = (torch.arange(cap, device=device) < counts[..., None]).reshape(-1)  # (E'*B*C,)
        x_row = (token_of_slot + torch.arange(batch, device=device)[:, None] * tokens).reshape(-1)  # (E'*B*C,)
        slot_gate = gates[..., head_ids].permute(2, 0, 1).gather(-1, token_of_slot).reshape(-1)  # (E'*B*C,)
        slot_gate = (slot_gate * in_use).unsqueeze(1)  # (E'*B*C, 1)
        sizes = [sum(counts_host[j]) for j in live]
        return cls(batch, tokens, live, head_ids, sizes, cap, x_row, in_use, slot_gate)


def _shared_heads_and_kv(w: Projections, x: torch.Tensor, gates: torch.Tensor, plan: SelectionPlan):
    """K and V of every used head, and the output buffer started with the shared heads
    (dense) and ``to_out``'s bias. Returns ``key``, ``value`` (B, N, hs + E', d) and ``out``
    (B*N, D)."""
    batch, tokens, rows = plan.batch, plan.tokens, plan.rows
    heads, head_dim, shared, dim = w.heads, w.head_dim, w.shared, x.shape[1]
    # No K and V biases, which saves a pass over each: the K bias adds q . b_k to a whole
    # row of scores, which softmax ignores, and the V bias passes through the attention
    # unchanged (the weights sum to 1), so it is added to the head outputs.
    kv_heads = torch.cat([torch.arange(shared, device=x.device), plan.head_ids])
    w_k, w_v = w.w_k, w.w_v  # (h*d, D)
    if len(kv_heads) < heads:
        w_k, w_v = _head_rows(w_k, kv_heads, head_dim), _head_rows(w_v, kv_heads, head_dim)
    key = F.linear(x, w_k).view(batch, tokens, -1, head_dim)  # (B, N, hs + E', d)
    value = F.linear(x, w_v).view(batch, tokens, -1, head_dim)  # (B, N, hs + E', d)

    out = x.new_empty(rows, dim)  # (B*N, D)
    if shared:
        width = shared * head_dim
        q = F.linear(x, w.w_q[:width], None if w.b_q is None else w.b_q[:width])
        q = q.view(batch, tokens, shared, head_dim).transpose(1, 2)  # (B, hs, N, d)
        o = F.scaled_dot_product_attention(
            q, key[:, :, :shared].transpose(1, 2), value[:, :, :shared].transpose(1, 2)
        )  # (B, hs, N, d)
        o = o.transpose(1, 2) if w.b_v is None else o.transpose(1, 2) + w.b_v.view(heads, head_dim)[:shared]  # (B, N, hs, d)
        o = (o * gates[..., :shared, None]).reshape(rows, width)  # (B*N, hs*d)
        _linear_into(out, o, w.w_out[:, :width], w.b_out)
    elif w.b_out is None:
        out.zero_()
    else:
        out.copy_(w.b_out.expand(rows, dim))
    return key, value, out


def _routed_core(w: Projections, plan: SelectionPlan, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """Attention of every slot's query (E'*B*C, d) against all N keys of its (head, image),
    V bias added, scaled by the slot's gate: (E'*B*C, d), zero in unused slots."""
    n, head_dim, shared = len(plan.live), w.head_dim, w.shared
    o = F.scaled_dot_product_attention(
        q.view(n, plan.batch, plan.cap, head_dim),
        key[:, :, shared:].permute(2, 0, 1, 3),  # (E', B, N, d)
        value[:, :, shared:].permute(2, 0, 1, 3),
    )  # (E', B, C, d)
    if w.b_v is not None:
        o = o + w.b_v.view(w.heads, head_dim)[plan.head_ids].view(n, 1, 1, head_dim)
    return o.reshape(-1, head_dim) * plan.slot_gate


# --------------------------------------------------------------------------------------
# The computation: (weights, input (B, N, D), routing) -> the output before to_out's
# dropout, (B, N, D)
# --------------------------------------------------------------------------------------


def per_head_attention(
    w: Projections, hidden_states: torch.Tensor, routing: Routing, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> torch.Tensor:
    """The shared heads are computed dense; K and V are projected once for the shared and
    the live routed heads; the Q and output projections loop over the live routed heads; each head's selected
    tokens of all images are packed without padding, gathered, projected and added back
    into their rows (``index_add_``) in blocks of ``block_bytes`` that stay in cache. On CPU
    the gather / scatter costs memory traffic, not FLOPs, so padding there and large
    buffers (above glibc's 32 MiB mmap threshold they are page-faulted in again on every
    call) would eat the savings."""
    batch, tokens, dim = hidden_states.shape
    x = hidden_states.reshape(batch * tokens, dim)  # (B*N, D)
    gates = routing.gates.to(hidden_states.dtype)  # (B, N, h)
    plan = SelectionPlan.of(routing, gates, w.shared)
    key, value, out = _shared_heads_and_kv(w, x, gates, plan)
    if plan.live:
        heads, head_dim, shared = w.heads, w.head_dim, w.shared
        w_q, w_o = w.w_q.view(heads, head_dim, dim), w.w_out.view(dim, heads, head_dim)  # (h, d, D), (D, h, d)
        used = plan.in_use.nonzero().squeeze(1)  # (P,) slots in use, by head, image, token
        used_rows = plan.x_row[used]  # (P,)
        bounds = [0]
        for size in plan.sizes:
            bounds.append(bounds[-1] + size)
        parts = [slice(bounds[p], bounds[p + 1]) for p in range(len(plan.live))]
        buffer = _block_buffer(x, block_bytes, w_q, w.b_q, w_o)
        q_used = x.new_empty(len(used), head_dim)  # (P, d)
        for part, j in zip(parts, plan.live):
            head = shared + j
            bias = None if w.b_q is None else w.b_q[head * head_dim:(head + 1) * head_dim]
            _gathered_linear(q_used[part], x, used_rows[part], w_q[head], bias, buffer)
        q = x.new_zeros(len(plan.in_use), head_dim).index_copy(0, used, q_used)  # (E'*B*C, d)
        o_used = _routed_core(w, plan, q, key, value).index_select(0, used)  # (P, d)
        for part, j in zip(parts, plan.live):
            _linear_scattered_add(out, used_rows[part], o_used[part], w_o[:, shared + j], buffer)
    return out.view(batch, tokens, dim)


# --------------------------------------------------------------------------------------
# The processor
# --------------------------------------------------------------------------------------


class MoHSparseAttnProcessor:
    """Head-sparse MoH attention; same call signature and result as ``MoHAttnProcessor``.

    Meant for inference. Its gradients equal the dense-masked ones too (unselected heads
    have a zero gate either way; tested), but training keeps the dense-masked path. It only
    computes: ``MoHAttention`` calls it when ``fast_paths.choose_path`` says the layer skips
    heads (eval mode, no autocast, routed density at most ``dense_above``, and in automatic
    mode the size and device conditions). Called directly it computes head-sparse whatever
    the density. Where there is nothing to skip (a dense layer, no routed heads, or a top-K
    that holds every routed head) it runs the layer's default, dense-masked processor. It
    refuses an autocast region: the projections would come out in another dtype than the
    buffers its in-place kernels write to (cast the model instead, or call the layer, which
    computes dense-masked there).

    Args:
        dense_above: routed density ``K / (h - hs)`` above which ``MoHAttention`` runs the
            layer dense-masked instead (``skips_at_density``): near full density gathering
            and scattering the selected tokens costs more than the skipped heads save.
            1.0 always skips.
        block_bytes: size of the reused row blocks of the Q and output projections (default
            ``DEFAULT_BLOCK_BYTES``, 8 MiB).
    """

    def __init__(self, dense_above: float = 0.8, block_bytes: int = DEFAULT_BLOCK_BYTES):
        if not 0.0 <= dense_above <= 1.0:
            raise ValueError(f"dense_above={dense_above} must be in [0, 1].")
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes={block_bytes!r} must be a positive integer (bytes).")
        self.dense_above = dense_above
        self.block_bytes = block_bytes

    def skips_heads(self, attn: Any) -> bool:
        """Whether ``attn``'s routed density lets it skip heads with this processor's
        ``dense_above`` (``skips_at_density``). Only the density part of the decision:
        ``fast_paths.choose_path`` makes the whole one."""
        return skips_at_density(attn.top_k, attn.num_routed_heads, self.dense_above)

    def __call__(self, attn: Any, hidden_states: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        if routing is None:
            routing = attn.route(hidden_states)
        # Nothing to skip: a dense layer, a layer without routed heads, or a top-K that
        # holds every routed head.
        if routing is None or routing.routed_index is None or routing.routed_index.shape[-1] >= attn.num_routed_heads:
            return attn._default_processor_cls()(attn, hidden_states, routing)
        attn.routing = routing  # where the block reads the statistics, as after the default processor
        if torch.is_autocast_enabled(hidden_states.device.type):
            raise ValueError(
                "MoHSparseAttnProcessor does not compute inside an autocast region; cast the model "
                "(model.to(dtype)) instead, or call the layer itself, which computes dense-masked there."
            )
        return attn.to_out[1](per_head_attention(Projections.of(attn), hidden_states, routing, self.block_bytes))


# --------------------------------------------------------------------------------------
# Block helpers
# --------------------------------------------------------------------------------------


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _block_buffer(x: torch.Tensor, block_bytes: int, *weights: torch.Tensor | None) -> torch.Tensor | None:
    """A reusable (R, D) block buffer of about ``block_bytes``, or None where autograd has
    to see every step (``out=`` arguments do not support autograd)."""
    if _needs_grad(x, *weights):
        return None
    return x.new_empty(max(1, block_bytes // (x.shape[1] * x.element_size())), x.shape[1])


def _gathered_linear(out, x, rows, weight, bias, buffer):
    """``out[...] = F.linear(x[rows], weight, bias)``, gathered and multiplied block by block
    when ``buffer`` is given (no autograd), else in one piece."""
    if buffer is None:
        out.copy_(F.linear(x.index_select(0, rows), weight, bias))
        return
    for start in range(0, len(rows), len(buffer)):
        block = rows[start:start + len(buffer)]
        xs = torch.index_select(x, 0, block, out=buffer[:len(block)])
        _linear_into(out[start:start + len(block)], xs, weight, bias)


def _linear_scattered_add(out, rows, a, weight, buffer):
    """``out[rows] += a @ weight.T`` (``rows`` distinct), block by block when ``buffer`` is given."""
    if buffer is None:
        out.index_add_(0, rows, F.linear(a, weight))
        return
    for start in range(0, len(rows), len(buffer)):
        block = rows[start:start + len(buffer)]
        y = torch.mm(a[start:start + len(block)], weight.t(), out=buffer[:len(block)])
        out.index_add_(0, block, y)


def _head_rows(weight: torch.Tensor | None, heads: torch.Tensor, head_dim: int) -> torch.Tensor | None:
    """Rows of a (h * d, ...) projection weight (or bias) that belong to ``heads``."""
    return None if weight is None else weight.unflatten(0, (-1, head_dim))[heads].flatten(0, 1)


def _linear_into(dst: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``dst[...] = a @ weight.T + bias`` without a temporary where autograd allows ``out=``."""
    if _needs_grad(a, weight, bias):
        dst.copy_(F.linear(a, weight, bias))
    elif bias is None:
        torch.mm(a, weight.t(), out=dst)
    else:
        torch.addmm(bias, a, weight.t(), out=dst)

