"""Test-only references for MoH attention: a loop over images, heads and tokens, and the
head-sparse / dense FLOP ratio. Not a test file (no ``test_`` prefix); tests/ is on
pytest's ``pythonpath`` (pyproject.toml), so tests ``import reference_attention``."""

from __future__ import annotations

from typing import Any

import torch

from moh_dit.models.flops import attention_flops


def ideal_flop_ratio(tokens: int, hidden: int, inner: int, ratio: float) -> float:
    """Head-sparse / dense FLOPs of one attention layer when a fraction ``ratio`` of the
    (token, head) pairs is active (:func:`moh_dit.models.flops.attention_flops`)."""
    return attention_flops(tokens, hidden, inner, ratio) / attention_flops(tokens, hidden, inner)


@torch.no_grad()
def sparse_attention_reference(attn: Any, hidden_states: torch.Tensor, routing: Any):
    """Readable head-sparse MoH attention: loops over images, heads and the tokens that use
    each head, reading the routed decision in top-K form (``routing.routed_index`` /
    ``routing.routed_gates``). float64 inside; slow."""
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
