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
order: the density rule, the weights and the selection plan the strategies share, the three
strategies (``per_head_attention``, ``batched_attention``, ``packed_attention``), the
processor, the block helpers.

Only portable torch operations are used (index_select, addmm / baddbmm,
scaled_dot_product_attention, nested tensors, index_add_), so the same code runs on CPU and
CUDA.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F


__all__ = [
    "STRATEGIES",
    "Routing",
    "skips_at_density",
    "Projections",
    "SelectionPlan",
    "per_head_attention",
    "batched_attention",
    "packed_attention",
    "MoHSparseAttnProcessor",
]

STRATEGIES = ("per_head", "batched", "packed")
# Size of one block of rows in the per-head strategy; the block buffer is reused, so no
# large buffer is allocated per call. Large rather than cache-sized: when other processes
# share the cores every extra call can wait for a busy core (docs/sparse_attention.md).
DEFAULT_BLOCK_BYTES = 8 << 20
# The packed strategy passes min / max sequence lengths to its nested tensors (so that SDPA
# needs no host sync to find them); older torch versions do not take them.
_JAGGED_TAKES_SEQLEN = "max_seqlen" in inspect.signature(torch.nested.nested_tensor_from_jagged).parameters


class Routing(Protocol):
    """What the strategies read of a layer's ``MoHRouting`` (``attention.py``)."""

    gates: torch.Tensor  # (B, N, h) float32, zero for routed heads a token did not select
    routed_index: torch.Tensor | None  # (B, N, K) long, indices into the routed heads
    routed_gates: torch.Tensor | None  # (B, N, K) float32


# --------------------------------------------------------------------------------------
# The density rule, and what the strategies share: the weights and the selection plan
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
    """Which token uses which routed head, computed once per call (one host sync); the
    ``per_head`` and ``batched`` strategies both work from it.

    Tokens are grouped by (live routed head, image). Slot c of a group holds the c-th token
    of that image that selected the head; groups are padded to the largest one, C. Unused
    slots read token 0 of their image with a zero gate (``batched`` writes them to a sink
    row; ``per_head`` leaves them out).
    """

    batch: int
    tokens: int
    live: list[int]  # routed heads (0 .. E-1) some token selected, E' of them
    head_ids: torch.Tensor  # (E',) their head ids, shared + live
    sizes: list[int]  # tokens that selected each live head, all images together
    cap: int  # C, the largest (head, image) group
    member: torch.Tensor  # (E', B, N) bool, token selected the head
    counts: torch.Tensor  # (E', B) group sizes
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
        return cls(batch, tokens, live, head_ids, sizes, cap, member, counts, x_row, in_use, slot_gate)


def _shared_heads_and_kv(w: Projections, x: torch.Tensor, gates: torch.Tensor, plan: SelectionPlan):
    """K and V of every used head, and the output buffer started with the shared heads
    (dense) and ``to_out``'s bias. Returns ``key``, ``value`` (B, N, hs + E', d) and ``out``
    (B*N + 1, D), whose extra sink row takes the unused slots of the batched strategy."""
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

    out = x.new_empty(rows + 1, dim)  # (B*N + 1, D)
    if shared:
        width = shared * head_dim
        q = F.linear(x, w.w_q[:width], None if w.b_q is None else w.b_q[:width])
        q = q.view(batch, tokens, shared, head_dim).transpose(1, 2)  # (B, hs, N, d)
        o = F.scaled_dot_product_attention(
            q, key[:, :, :shared].transpose(1, 2), value[:, :, :shared].transpose(1, 2)
        )  # (B, hs, N, d)
        o = o.transpose(1, 2) if w.b_v is None else o.transpose(1, 2) + w.b_v.view(heads, head_dim)[:shared]  # (B, N, hs, d)
        o = (o * gates[..., :shared, None]).reshape(rows, width)  # (B*N, hs*d)
        _linear_into(out[:rows], o, w.w_out[:, :width], w.b_out)
    elif w.b_out is None:
        out[:rows].zero_()
    else:
        out[:rows].copy_(w.b_out.expand(rows, dim))
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
# The strategies: each maps (weights, input (B, N, D), routing) to the output before
# to_out's dropout, (B, N, D)
# --------------------------------------------------------------------------------------


def _plan_and_shared_heads(w: Projections, hidden_states: torch.Tensor, routing: Routing):
    """What the per-head and batched strategies start with: the input as rows (B*N, D), the
    selection plan, K and V of every used head, and the output rows holding the shared
    heads' part (plus to_out's bias and the sink row)."""
    batch, tokens, dim = hidden_states.shape
    x = hidden_states.reshape(batch * tokens, dim)  # (B*N, D)
    gates = routing.gates.to(hidden_states.dtype)  # (B, N, h)
    plan = SelectionPlan.of(routing, gates, w.shared)
    key, value, out = _shared_heads_and_kv(w, x, gates, plan)
    return x, plan, key, value, out


def per_head_attention(
    w: Projections, hidden_states: torch.Tensor, routing: Routing, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> torch.Tensor:
    """The Q and output projections loop over the live routed heads; each head's selected
    tokens of all images are packed without padding, gathered, projected and added back
    into their rows (``index_add_``) in blocks of ``block_bytes`` that stay in cache. On CPU
    the gather / scatter costs memory traffic, not FLOPs, so padding there and large
    buffers (above glibc's 32 MiB mmap threshold they are page-faulted in again on every
    call) would eat the savings."""
    batch, tokens, dim = hidden_states.shape
    x, plan, key, value, out = _plan_and_shared_heads(w, hidden_states, routing)
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
    return out[: plan.rows].view(batch, tokens, dim)


def batched_attention(w: Projections, hidden_states: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The Q and output projections of all live routed heads are single padded bmm calls
    (few kernel launches); padded slots read token 0 and write to a sink row. On CUDA its
    ``index_add_`` of the heads' output rows uses atomics, so results may differ in the last
    bits between runs."""
    batch, tokens, dim = hidden_states.shape
    x, plan, key, value, out = _plan_and_shared_heads(w, hidden_states, routing)
    if plan.live:
        heads, head_dim, n, chosen = w.heads, w.head_dim, len(plan.live), plan.head_ids
        xs = x.index_select(0, plan.x_row).view(n, batch * plan.cap, dim)  # (E', B*C, D)
        w_q = w.w_q.view(heads, head_dim, dim)[chosen].transpose(1, 2)  # (E', D, d)
        if w.b_q is None:
            q = torch.bmm(xs, w_q)
        else:
            q = torch.baddbmm(w.b_q.view(heads, 1, head_dim)[chosen], xs, w_q)  # (E', B*C, d)
        o = _routed_core(w, plan, q, key, value)  # (E'*B*C, d)
        w_o = w.w_out.view(dim, heads, head_dim)[:, chosen].permute(1, 2, 0)  # (E', d, D)
        y = torch.bmm(o.view(n, batch * plan.cap, head_dim), w_o)  # (E', B*C, D)
        out.index_add_(0, torch.where(plan.in_use, plan.x_row, plan.rows), y.view(-1, dim))
    return out[: plan.rows].view(batch, tokens, dim)


def packed_attention(w: Projections, hidden_states: torch.Tensor, routing: Routing) -> torch.Tensor:
    """No host sync, no Python loop over heads, static shapes except inside the attention
    core; so it does not use the ``SelectionPlan`` (whose live heads and group sizes are
    read on the host).

    Q, K and V are projected for all heads and the output projection is one GEMM over
    all heads (on a GPU these GEMMs are cheap, while gathering and scattering D-wide
    rows per (token, head) pair moves more bytes than the whole dense layer). What is
    skipped is the attention core, the part that grows with N: the B*N*K selected
    (token, head) pairs are sorted into (routed head, image) groups, and one jagged
    SDPA call (nested tensor; flash / memory-efficient varlen kernels on CUDA) attends
    each group's queries to its N keys. Every group carries one extra sink query (gate
    0, written to a discarded row), so no group is empty: fused kernels refuse
    zero-length sequences. Unselected pairs stay zero before the output projection.
    """
    if not _JAGGED_TAKES_SEQLEN:
        raise RuntimeError(
            f"the 'packed' head-sparse strategy needs a torch whose nested_tensor_from_jagged takes "
            f"min_seqlen / max_seqlen (torch {torch.__version__} does not); use strategy='batched' or 'per_head'."
        )
    batch, tokens, dim = hidden_states.shape
    heads, head_dim, shared = w.heads, w.head_dim, w.shared
    rows, groups = batch * tokens, (heads - shared) * batch
    x = hidden_states.reshape(rows, dim)  # (B*N, D)
    query = F.linear(x, w.w_q, w.b_q).view(rows, heads, head_dim)  # (B*N, h, d)
    key = F.linear(x, w.w_k, w.b_k).view(batch, tokens, heads, head_dim)  # (B, N, h, d)
    value = F.linear(x, w.w_v, w.b_v).view(batch, tokens, heads, head_dim)

    # Gated attention output of every (token, head) pair, zero where not selected; then
    # one sink row per group.
    z = x.new_zeros(rows * heads + groups, head_dim)
    if shared:
        o = F.scaled_dot_product_attention(
            query.view(batch, tokens, heads, head_dim)[:, :, :shared].transpose(1, 2),
            key[:, :, :shared].transpose(1, 2), value[:, :, :shared].transpose(1, 2),
        )  # (B, hs, N, d)
        o = o.transpose(1, 2) * routing.gates[..., :shared, None].to(o.dtype)  # (B, N, hs, d)
        z[: rows * heads].view(rows, heads, head_dim)[:, :shared] = o.reshape(rows, shared, head_dim)

    if routing.routed_index.shape[-1]:  # routed heads (K = 0 leaves only the shared heads on)
        _packed_routed(z, query, key, value, routing, shared)
    out = F.linear(z[: rows * heads].view(rows, heads * head_dim), w.w_out, w.b_out)  # (B*N, D)
    return out.view(batch, tokens, dim)


def _packed_routed(z, query, key, value, routing, shared):
    """Write the gated outputs of the selected (token, routed head) pairs into ``z``
    ((B*N*h + G, d): rows ``token * h + head``, then one sink row per group)."""
    batch, tokens, heads, head_dim = key.shape
    k, device = routing.routed_index.shape[-1], key.device
    rows, groups = batch * tokens, (heads - shared) * batch

    # The selected pairs (ordered by image, token, slot) and one sink per group, sorted
    # into groups g = routed head * B + image, sinks last in their group.
    pairs = rows * k
    head = torch.cat([routing.routed_index.reshape(-1), torch.arange(groups, device=device) // batch])  # (P+G,)
    image = torch.cat([
        torch.arange(batch, device=device).repeat_interleave(tokens * k), torch.arange(groups, device=device) % batch
    ])
    sink = torch.arange(pairs + groups, device=device) >= pairs
    group = head * batch + image  # (P+G,)
    order = torch.argsort(group * 2 + sink, stable=True)
    head, sink, group = head[order], sink[order], group[order]
    row = torch.cat([torch.arange(rows, device=device).repeat_interleave(k), torch.zeros(groups, dtype=torch.long, device=device)])[order]
    gate = torch.cat([routing.routed_gates.reshape(-1), routing.routed_gates.new_zeros(groups)])[order]
    # Group sizes by scatter_add (bincount would sync on CUDA to size its output); each >= 1.
    lengths = torch.zeros(groups, dtype=torch.long, device=device).scatter_add_(0, group, torch.ones_like(group))
    offsets = F.pad(lengths.cumsum(0), (1, 0))  # (G+1,)

    q = query[row, shared + head].unsqueeze(1)  # (P+G, 1, d)
    kv_offsets = torch.arange(groups + 1, device=device) * tokens
    kv = [t[:, :, shared:].permute(2, 0, 1, 3).reshape(groups * tokens, 1, head_dim) for t in (key, value)]
    nested = torch.nested.nested_tensor_from_jagged
    o = F.scaled_dot_product_attention(
        nested(q, offsets, min_seqlen=1, max_seqlen=tokens + 1).transpose(1, 2),
        nested(kv[0], kv_offsets, min_seqlen=tokens, max_seqlen=tokens).transpose(1, 2),
        nested(kv[1], kv_offsets, min_seqlen=tokens, max_seqlen=tokens).transpose(1, 2),
    ).transpose(1, 2).values().squeeze(1)  # (P+G, d), in the packed order
    target = torch.where(sink, rows * heads + group, row * heads + shared + head)  # rows of z
    z.index_copy_(0, target, o * gate.to(o.dtype).unsqueeze(1))


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
        strategy: how the routed heads are processed: ``"per_head"``
            (``per_head_attention``), ``"batched"`` (``batched_attention``) or ``"packed"``
            (``packed_attention``). ``per_head`` and ``batched`` run the attention of all
            routed heads as one SDPA call on (head, image) groups padded to the largest
            group (padding costs only SDPA work there), and read the group sizes on the
            host (one sync). ``packed`` has no host sync and no loop over heads;
            projections stay dense and only the attention core skips, at the price of
            nested-tensor dispatch on the host. ``None`` (default): ``"per_head"`` on CPU,
            ``"batched"`` elsewhere.
        dense_above: routed density ``K / (h - hs)`` above which ``MoHAttention`` runs the
            layer dense-masked instead (``skips_at_density``): near full density gathering
            and scattering the selected tokens costs more than the skipped heads save.
            1.0 always skips.
        block_bytes: size of the reused row blocks of the ``per_head`` strategy (default
            ``DEFAULT_BLOCK_BYTES``, 8 MiB).
    """

    def __init__(self, strategy: str | None = None, dense_above: float = 0.8, block_bytes: int = DEFAULT_BLOCK_BYTES):
        if strategy is not None and strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}; choose one of {STRATEGIES} or None (automatic).")
        if not 0.0 <= dense_above <= 1.0:
            raise ValueError(f"dense_above={dense_above} must be in [0, 1].")
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes={block_bytes!r} must be a positive integer (bytes).")
        self.strategy = strategy
        self.dense_above = dense_above
        self.block_bytes = block_bytes

    def skips_heads(self, attn: Any) -> bool:
        """Whether ``attn``'s routed density lets it skip heads with this processor's
        ``dense_above`` (``skips_at_density``). Only the density part of the decision:
        ``fast_paths.choose_path`` makes the whole one."""
        return skips_at_density(attn.top_k, attn.num_routed_heads, self.dense_above)

    @staticmethod
    def default_strategy(device: torch.device) -> str:
        """The strategy used when none is given: ``"per_head"`` on CPU, ``"batched"`` elsewhere
        (on a GPU the padded bmm calls need the fewest kernel launches)."""
        return "per_head" if device.type == "cpu" else "batched"

    def __call__(self, attn: Any, hidden_states: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        if routing is None:
            routing = attn.route(hidden_states)
        # Nothing to skip: a dense layer, a layer without routed heads, or a top-K that
        # holds every routed head.
        if routing is None or routing.routed_index is None or routing.routed_index.shape[-1] >= attn.num_routed_heads:
            return attn._default_processor_cls()(attn, hidden_states, routing)
        attn.routing = routing  # where the block reads the statistics, as after the default processor
        device = hidden_states.device
        if torch.is_autocast_enabled(device.type):
            raise ValueError(
                "MoHSparseAttnProcessor does not compute inside an autocast region; cast the model "
                "(model.to(dtype)) instead, or call the layer itself, which computes dense-masked there."
            )
        strategy = self.strategy or self.default_strategy(device)
        compute = {
            "per_head": functools.partial(per_head_attention, block_bytes=self.block_bytes),
            "batched": batched_attention,
            "packed": packed_attention,
        }[strategy]
        return attn.to_out[1](compute(Projections.of(attn), hidden_states, routing))


# --------------------------------------------------------------------------------------
# Helpers of the per-head and batched strategies
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

