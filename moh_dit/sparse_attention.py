"""Head-sparse MoH attention for inference: unselected routed heads cost nothing.

The dense-masked processor (``MoHAttnProcessor``) computes every head for every token and
multiplies unselected routed heads by a zero gate, as the authors' release does, so MoH
saves no compute there. ``MoHSparseAttnProcessor`` computes the same result while doing,
per routed head, only the work of the tokens that selected it:

- shared heads (always on) stay dense: one SDPA on their slice of the projections;
- K and V are projected once for every head that some token of the batch uses (all keys
  and values of a used head are needed: any token may attend to any other);
- for routed head j and image b, the tokens that selected j are gathered, projected to
  queries with j's slice of ``to_q``, attended against all N keys of (b, j), scaled by their
  gate, projected with j's slice of ``to_out`` and added into their output rows.

Per-token FLOPs (docs/design.md, section 4), with r the fraction of active (token, head)
pairs: dense ``2 D D_in * 4 + 4 N D_in``, head-sparse ideal ``2 D D_in (2 + 2r) + 4 r N D_in``.

The FLOPs go, but not the bytes: each selected (token, head) pair gathers a D-wide input
row and adds back a D-wide output row, so the layer moves about as much memory as the
dense one. On 2 CPU cores that keeps the measured time 15-30 % above the FLOP ratio
(``scripts/benchmark_attention.py``); CPU flash attention is also ~15 % less efficient per
query at 512 queries than at 1024. On an H200 every strategy was slower than dense (launches,
the host sync, the gathers and bf16 ``index_add_`` dominate there), so automatic mode only
uses this path on the CPU (``MoHAttention.uses_sparse_processor``).

Only portable torch operations are used (index_select, addmm / baddbmm,
scaled_dot_product_attention, nested tensors, index_add_), so the same code runs on CPU and
CUDA. ``sparse_attention_reference`` is a plain loop over images, heads and tokens, kept for
tests.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .transformer_moh_dit import MoHAttention, MoHRouting

__all__ = ["MoHSparseAttnProcessor", "sparse_attention_reference", "ideal_flop_ratio"]

STRATEGIES = ("per_head", "batched", "packed")
# The packed strategy passes min / max sequence lengths to its nested tensors (so that SDPA
# needs no host sync to find them); older torch versions do not take them.
_JAGGED_TAKES_SEQLEN = "max_seqlen" in inspect.signature(torch.nested.nested_tensor_from_jagged).parameters


def ideal_flop_ratio(tokens: int, hidden: int, inner: int, ratio: float) -> float:
    """Head-sparse / dense FLOPs of one attention layer when a fraction ``ratio`` of the
    (token, head) pairs is active: Q and output projections and the attention core scale
    with ``ratio``, K and V projections do not (docs/design.md, section 4)."""
    dense = 2 * tokens * hidden * inner * 4 + 4 * tokens**2 * inner
    sparse = 2 * tokens * hidden * inner * (2 + 2 * ratio) + 4 * ratio * tokens**2 * inner
    return sparse / dense


class MoHSparseAttnProcessor:
    """Head-sparse MoH attention; same call signature and result as ``MoHAttnProcessor``.

    Meant for inference. Its gradients equal the dense-masked ones too (unselected heads
    have a zero gate either way; tested), but training keeps the dense-masked path. A dense
    layer, a layer without routed heads and a layer whose tokens select more than
    ``dense_above`` of its routed heads run the dense-masked computation instead: there is
    nothing to skip, or too little to pay for gathering and scattering the selected tokens.
    Inside an autocast region it also computes dense-masked (cast the model instead).

    Args:
        strategy: how the routed heads are processed.
            ``"per_head"``: the Q and output projections loop over the routed heads; each
            head's selected tokens of all images are packed without padding, gathered,
            projected and added back into their rows (``index_add_``) in blocks of rows
            that stay in cache. On CPU the gather / scatter costs memory traffic, not
            FLOPs, so padding there and large buffers (above glibc's 32 MiB mmap threshold
            they are page-faulted in again on every call) would eat the savings.
            ``"batched"``: the projections of all routed heads are single padded bmm calls:
            few kernel launches.
            Both run the attention of all routed heads as one SDPA call on (head, image)
            groups padded to the largest group (padding costs only SDPA work there), and
            read the group sizes on the host (one sync). On CUDA its ``index_add_`` of the
            heads' output rows uses atomics, so results may differ in the last bits between
            runs.
            ``"packed"``: no host sync and no loop over heads; projections stay dense and
            only the attention core skips (see ``_packed``). On an H200 (torch 2.11) its
            GPU time was about dense's but nested-tensor dispatch cost ~7 ms of CPU time
            per call.
            ``None`` (default): ``"per_head"`` on CPU, ``"batched"`` elsewhere.
        dense_above: routed density ``K / (h - hs)`` above which a layer runs dense-masked.
            On 2 CPU cores skipping stopped paying between 0.75 and 0.875 (XL width, 1024
            tokens: 12 of 16 heads 0.98x dense, 14 of 16 1.07x); 1.0 always skips.
    """

    def __init__(self, strategy: str | None = None, dense_above: float = 0.8):
        if strategy is not None and strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}; choose one of {STRATEGIES} or None (automatic).")
        if not 0.0 <= dense_above <= 1.0:
            raise ValueError(f"dense_above={dense_above} must be in [0, 1].")
        self.strategy = strategy
        self.dense_above = dense_above
        self._dense = None

    def skips_heads(self, attn: MoHAttention) -> bool:
        """Whether this processor skips unselected heads of ``attn`` (else it runs dense-masked)."""
        routed = attn.num_routed_heads
        return bool(routed) and attn.top_k < routed and attn.top_k <= self.dense_above * routed

    def _dense_masked(self, attn: MoHAttention, hidden_states: torch.Tensor, routing: MoHRouting | None):
        if self._dense is None:
            from .transformer_moh_dit import MoHAttnProcessor

            self._dense = MoHAttnProcessor()
        return self._dense(attn, hidden_states, routing)

    def __call__(self, attn: MoHAttention, hidden_states: torch.Tensor, routing: MoHRouting | None = None):
        if (
            routing is None or routing.routed_index is None or not self.skips_heads(attn)
            # Under autocast the projections come out in another dtype than the input, and
            # the out= / in-place kernels below would mix them: compute dense-masked there.
            or torch.is_autocast_enabled(hidden_states.device.type)
        ):
            return self._dense_masked(attn, hidden_states, routing)
        strategy = self.strategy or self.default_strategy(hidden_states.device)
        if strategy == "packed":
            return self._packed(attn, hidden_states, routing)
        batch, tokens, dim = hidden_states.shape
        heads, head_dim = attn.heads, attn.inner_dim // attn.heads
        shared, routed = attn.num_shared_heads, attn.num_routed_heads
        device = hidden_states.device
        rows = batch * tokens
        x = hidden_states.reshape(rows, dim)  # (B*N, D)
        gates = routing.gates.to(hidden_states.dtype)  # (B, N, h)

        # Which tokens selected which routed head; one host sync for the counts.
        member = torch.zeros(batch, tokens, routed, dtype=torch.bool, device=device)
        member = member.scatter_(-1, routing.routed_index, True).permute(2, 0, 1)  # (E, B, N)
        counts = member.sum(-1)  # (E, B)
        counts_host = counts.tolist()
        live = [j for j in range(routed) if any(counts_host[j])]  # routed heads some token uses
        live_t = torch.tensor(live, dtype=torch.long, device=device)

        # K and V once for every head that some token uses (shared heads + live routed ones),
        # without their biases, which saves a pass over each: the K bias adds q . b_k to a
        # whole row of scores, which softmax ignores, and the V bias passes through the
        # attention unchanged (the weights sum to 1), so it is added to the head outputs.
        kv_heads = torch.cat([torch.arange(shared, device=device), shared + live_t])
        w_k, w_v = attn.to_k.weight, attn.to_v.weight  # (h*d, D)
        if len(kv_heads) < heads:
            w_k, w_v = _head_rows(w_k, kv_heads, head_dim), _head_rows(w_v, kv_heads, head_dim)
        key = F.linear(x, w_k).view(batch, tokens, -1, head_dim)  # (B, N, hs + E', d)
        value = F.linear(x, w_v).view(batch, tokens, -1, head_dim)  # (B, N, hs + E', d)
        b_v = None if attn.to_v.bias is None else attn.to_v.bias.view(heads, head_dim)  # (h, d)

        # Shared heads, dense; this also starts the output with to_out's bias. The output
        # buffer has one extra sink row that padded slots of the batched strategy write to.
        out = x.new_empty(rows + 1, dim)  # (B*N + 1, D)
        w_out, b_out = attn.to_out[0].weight, attn.to_out[0].bias  # (D, h*d), (D,)
        if shared:
            width = shared * head_dim
            q = F.linear(x, attn.to_q.weight[:width], None if attn.to_q.bias is None else attn.to_q.bias[:width])
            q = q.view(batch, tokens, shared, head_dim).transpose(1, 2)  # (B, hs, N, d)
            o = F.scaled_dot_product_attention(
                q, key[:, :, :shared].transpose(1, 2), value[:, :, :shared].transpose(1, 2)
            )  # (B, hs, N, d)
            o = o.transpose(1, 2) if b_v is None else o.transpose(1, 2) + b_v[:shared]  # (B, N, hs, d)
            o = (o * gates[..., :shared, None]).reshape(rows, width)  # (B*N, hs*d)
            _linear_into(out[:rows], o, w_out[:, :width], b_out)
        elif b_out is None:
            out[:rows].zero_()
        else:
            out[:rows].copy_(b_out.expand(rows, dim))

        if live:
            self._routed(attn, x, gates, member[live_t], counts[live_t], counts_host, live, key, value, b_v, out, strategy)
        out = out[:rows].view(batch, tokens, dim)  # (B, N, D)
        return attn.to_out[1](out)

    @staticmethod
    def default_strategy(device: torch.device) -> str:
        """The strategy used when none is given: ``"per_head"`` on CPU, ``"batched"`` elsewhere
        (on an H200 it was the fastest of the three, though still slower than dense-masked)."""
        return "per_head" if device.type == "cpu" else "batched"

    @staticmethod
    def _packed(attn, hidden_states, routing):
        """The packed strategy: no host sync, no Python loop over heads, static shapes
        except inside the attention core.

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
        heads, head_dim = attn.heads, attn.inner_dim // attn.heads
        shared, routed, k = attn.num_shared_heads, attn.num_routed_heads, attn.top_k
        rows, groups = batch * tokens, routed * batch
        x = hidden_states.reshape(rows, dim)  # (B*N, D)
        query = attn.to_q(x).view(rows, heads, head_dim)  # (B*N, h, d)
        key = attn.to_k(x).view(batch, tokens, heads, head_dim)  # (B, N, h, d)
        value = attn.to_v(x).view(batch, tokens, heads, head_dim)

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

        if k:  # routed heads (K = 0 leaves only the shared heads on)
            MoHSparseAttnProcessor._packed_routed(z, query, key, value, routing, shared)
        out = attn.to_out[0](z[: rows * heads].view(rows, heads * head_dim))  # (B*N, D)
        return attn.to_out[1](out).view(batch, tokens, dim)

    @staticmethod
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

    @staticmethod
    def _routed(attn, x, gates, member, counts, counts_host, live, key, value, b_v, out, strategy):
        """Add the routed heads' output into ``out``. ``live`` lists the routed heads some
        token selected; ``member`` (E', B, N) and ``counts`` (E', B) are theirs."""
        heads, shared, n = attn.heads, attn.num_shared_heads, len(live)
        batch, tokens, _, head_dim = key.shape
        rows, dim, device = batch * tokens, x.shape[1], x.device
        chosen = shared + torch.tensor(live, device=device)  # (E',) head ids
        cap = max(max(counts_host[j]) for j in live)
        # Slot c of group (head, image) holds the c-th token of that image that selected the
        # head; groups are padded to the largest one, C. Unused slots read token 0 with a
        # zero gate and write to the sink row ``rows`` of ``out``.
        slot = torch.where(member, member.cumsum(-1) - 1, cap)  # (E', B, N)
        token_of_slot = torch.zeros(n, batch, cap + 1, dtype=torch.long, device=device)
        token_of_slot.scatter_(-1, slot, torch.arange(tokens, device=device).expand_as(slot))
        token_of_slot = token_of_slot[..., :cap]  # (E', B, C)
        in_use = (torch.arange(cap, device=device) < counts[..., None]).reshape(-1)  # (E'*B*C,)
        x_row = (token_of_slot + torch.arange(batch, device=device)[:, None] * tokens).reshape(-1)  # (E'*B*C,)
        slot_gate = gates[..., chosen].permute(2, 0, 1).gather(-1, token_of_slot).reshape(-1)  # (E'*B*C,)
        slot_gate = (slot_gate * in_use).unsqueeze(1)  # (E'*B*C, 1), zero in unused slots
        w_q, b_q = attn.to_q.weight.view(heads, head_dim, dim), attn.to_q.bias  # (h, d, D), (h*d,)
        w_o = attn.to_out[0].weight.view(dim, heads, head_dim)  # (D, h, d)

        if strategy == "batched":
            # One padded bmm for all heads' queries.
            xs = x.index_select(0, x_row).view(n, batch * cap, dim)  # (E', B*C, D)
            w = w_q[chosen].transpose(1, 2)  # (E', D, d)
            q = torch.bmm(xs, w) if b_q is None else torch.baddbmm(b_q.view(heads, 1, head_dim)[chosen], xs, w)
        else:
            # Packed slots (no padding), head by head, gathered and projected block by block.
            used = in_use.nonzero().squeeze(1)  # (P,) slots in use, by head, image, token
            used_rows = x_row[used]  # (P,)
            q_used = x.new_empty(len(used), head_dim)  # (P, d)
            bounds = [0]
            for j in live:
                bounds.append(bounds[-1] + sum(counts_host[j]))
            buffer = _block_buffer(x, w_q, b_q, w_o)
            for p, j in enumerate(live):
                part, head = slice(bounds[p], bounds[p + 1]), shared + j
                bias = None if b_q is None else b_q[head * head_dim:(head + 1) * head_dim]
                _gathered_linear(q_used[part], x, used_rows[part], w_q[head], bias, buffer)
            q = x.new_zeros(n * batch * cap, head_dim).index_copy(0, used, q_used)  # (E'*B*C, d)

        o = F.scaled_dot_product_attention(
            q.view(n, batch, cap, head_dim),
            key[:, :, shared:].permute(2, 0, 1, 3),  # (E', B, N, d)
            value[:, :, shared:].permute(2, 0, 1, 3),
        )  # (E', B, C, d)
        if b_v is not None:
            o = o + b_v[chosen].view(n, 1, 1, head_dim)
        o = o.reshape(-1, head_dim) * slot_gate  # (E'*B*C, d), zero in unused slots

        if strategy == "batched":
            y = torch.bmm(o.view(n, batch * cap, head_dim), w_o[:, chosen].permute(1, 2, 0))  # (E', B*C, D)
            out.index_add_(0, torch.where(in_use, x_row, rows), y.view(-1, dim))
        else:
            o_used = o.index_select(0, used)  # (P, d)
            for p, j in enumerate(live):
                part = slice(bounds[p], bounds[p + 1])
                _linear_scattered_add(out, used_rows[part], o_used[part], w_o[:, shared + j], buffer)


# Size of one block of rows in the per-head strategy; the block buffer is reused, so no
# large buffer is allocated per call. Measured on 2 CPU cores: with 1 thread 2 MiB blocks
# (cache-resident) made the layer ~4 % faster than whole-head buffers, with 2 threads the
# block size made no measurable difference, and when other processes share the cores every
# extra call can wait for a busy core, so blocks are large.
_BLOCK_BYTES = 8 << 20


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _block_buffer(x: torch.Tensor, *weights: torch.Tensor | None) -> torch.Tensor | None:
    """A reusable (R, D) block buffer, or None where autograd has to see every step
    (``out=`` arguments do not support autograd)."""
    if _needs_grad(x, *weights):
        return None
    return x.new_empty(max(1, _BLOCK_BYTES // (x.shape[1] * x.element_size())), x.shape[1])


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


@torch.no_grad()
def sparse_attention_reference(attn: MoHAttention, hidden_states: torch.Tensor, routing: MoHRouting | None):
    """Readable head-sparse MoH attention: loops over images, heads and the tokens that use
    each head, reading the routed decision in top-K form (``routing.routed_index`` /
    ``routing.routed_gates``). float64 inside; slow; for tests only."""
    batch, tokens, dim = hidden_states.shape
    heads, d = attn.heads, attn.inner_dim // attn.heads
    shared = attn.num_shared_heads if routing is not None else heads
    out = torch.zeros(batch, tokens, dim, dtype=torch.float64)
    w_q, w_k, w_v = (lin.weight.double().view(heads, d, dim) for lin in (attn.to_q, attn.to_k, attn.to_v))
    b_q, b_k, b_v = (
        lin.bias.double().view(heads, d) if lin.bias is not None else torch.zeros(heads, d, dtype=torch.float64)
        for lin in (attn.to_q, attn.to_k, attn.to_v)
    )
    w_o = attn.to_out[0].weight.double().view(dim, heads, d)
    for b in range(batch):
        x = hidden_states[b].double()  # (N, D)
        users: list[dict[int, float]] = [{} for _ in range(heads)]  # head -> {token: gate}
        for t in range(tokens):
            for i in range(shared):
                users[i][t] = 1.0 if routing is None else float(routing.gates[b, t, i])
            if routing is not None and routing.routed_index is not None:
                for j, g in zip(routing.routed_index[b, t].tolist(), routing.routed_gates[b, t].tolist()):
                    users[shared + j][t] = g
        for i in range(heads):
            if not users[i]:
                continue
            chosen = torch.tensor(list(users[i]))
            gate = torch.tensor(list(users[i].values()), dtype=torch.float64)
            q = x[chosen] @ w_q[i].T + b_q[i]  # (n, d)
            k = x @ w_k[i].T + b_k[i]  # (N, d)
            v = x @ w_v[i].T + b_v[i]  # (N, d)
            a = torch.softmax(q @ k.T / d**0.5, dim=-1) @ v  # (n, d)
            out[b, chosen] += (gate[:, None] * a) @ w_o[:, i].T  # (n, D)
    if attn.to_out[0].bias is not None:
        out += attn.to_out[0].bias.double()
    return out.to(hidden_states.dtype)
