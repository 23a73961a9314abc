"""Head-sparse MoH inference (``set_sparse_inference(True)``) against the dense-masked path and a
loop reference (``reference_attention``), per layer and through the model, with gradients."""

import pytest
import torch

from moh_dit.models import PRESETS, HeadLayout, MoHAttention, MoHAttnProcessor, MoHDiTTransformer2DModel, MoHRouting
from moh_dit.models.sparse import MoHSparseAttnProcessor

import reference_attention as reference  # test-only helpers (tests/ is on pytest's pythonpath)

DENSE, SPARSE = MoHAttnProcessor(), MoHSparseAttnProcessor()

pytestmark = pytest.mark.usefixtures("one_thread")


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def layer(h, hs, k, dim=16, head_dim=4, seed=0, bias=True):
    torch.manual_seed(seed)
    attn = MoHAttention(dim, h, head_dim, hs, k, bias=bias).eval()
    with torch.no_grad():  # non-zero biases everywhere, so a missed or doubled bias shows
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return attn


def crafted_routing(attn, batch, tokens, allowed, seed=0):
    """A top-K decision that only ever picks routed heads in ``allowed`` (the others are used by no
    token), with random positive gates."""
    gen = torch.Generator().manual_seed(seed)
    hs, e, k = attn.num_shared_heads, attn.num_routed_heads, attn.top_k
    scores = torch.rand(batch, tokens, e, generator=gen)
    scores[..., [j for j in range(e) if j not in allowed]] = -1.0
    routed_index = scores.topk(k, dim=-1).indices  # (B, N, K)
    routed_gates = torch.rand(batch, tokens, k, generator=gen) + 0.1
    gates = torch.cat([torch.rand(batch, tokens, hs, generator=gen) + 0.1,
                       torch.zeros(batch, tokens, e).scatter(-1, routed_index, routed_gates)], dim=-1)
    return MoHRouting(gates, routed_index, routed_gates)


def preset_layouts():
    """Distinct (h, hs, K) of every MoH preset at its trained top-K and at other ratios."""
    found = set()
    for cfg in PRESETS.values():
        layout = HeadLayout.of_config(cfg)
        if layout.is_moh:
            low = layout.reachable_range()[0]
            for ratio in [r for r in (1.0, 0.9, 0.75, 0.5) if r >= low] + [low]:
                found.update(zip(layout.heads, layout.shared, layout.top_k_for_ratio(ratio)))
    return sorted(found)


# Every (h, hs, K) with hs = 0, 1, many and K = 1 .. h - hs for small h, and every preset's.
LAYOUTS = [(h, hs, k, 16, 4) for h in (3, 5) for hs in range(h) for k in range(1, h - hs + 1)]


@pytest.mark.parametrize("h, hs, k, dim, head_dim", LAYOUTS + [(*layout, 24, 2) for layout in preset_layouts()])
def test_sparse_equals_dense_masked_fp32(h, hs, k, dim, head_dim):
    attn = layer(h, hs, k, dim, head_dim)
    for batch, tokens in [(1, 1), (3, 17)]:
        x = torch.randn(batch, tokens, dim)
        with torch.no_grad():
            routing = attn.route(x)
            assert rel_err(SPARSE(attn, x, routing), DENSE(attn, x, routing)) <= 1e-5, (batch, tokens)


@pytest.mark.parametrize("h, hs, k, allowed, bias",
                         [(6, 0, 1, [2], True), (6, 0, 2, [0, 5], True), (7, 2, 2, [1, 3, 4], False),
                          (7, 1, 1, [4], True), (8, 3, 3, [0, 1, 2, 3], True), (5, 1, 2, None, True)])
def test_loop_reference_and_heads_no_token_selects(h, hs, k, allowed, bias):
    """The loop reference equals the dense-masked path, and so does the sparse one where some
    routed heads are used by no token (and without biases)."""
    attn = layer(h, hs, k, bias=bias)
    x = torch.randn(2, 13, 16)
    with torch.no_grad():
        routing = attn.route(x) if allowed is None else crafted_routing(attn, 2, 13, allowed)
        ref = DENSE(attn, x, routing)
        assert rel_err(SPARSE(attn, x, routing), ref) <= 1e-5
        assert rel_err(reference.sparse_attention_reference(attn, x, routing), ref) <= 1e-5


def test_bf16_and_autocast():
    """bf16 weights: both paths within bf16 rounding of fp32. Inside autocast (the projections
    change dtype) the sparse processor computes dense-masked."""
    attn = layer(6, 0, 2)
    x = torch.randn(3, 20, 16)
    with torch.no_grad():
        routing = attn.route(x)
        exact = DENSE(attn, x, routing)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(SPARSE(attn, x, routing), DENSE(attn, x, routing))
        attn.to(torch.bfloat16)
        dense, sparse = DENSE(attn, x.bfloat16(), routing), SPARSE(attn, x.bfloat16(), routing)
    assert sparse.dtype == torch.bfloat16 and rel_err(sparse, dense) <= 2e-2 and rel_err(sparse, exact) <= 2e-2
    assert rel_err(dense, exact) > 1e-4  # bf16 really ran


UNEVEN = dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=48, num_layers=4, attention_head_dim=12,
              num_attention_heads=[2, 4, 6, 5], num_shared_heads=[2, 0, 4, 1], top_k=[0, 2, 1, 3], num_classes=7)


def model_and_inputs(randomize, cfg="UNEVEN", batch=3):
    model = MoHDiTTransformer2DModel(**UNEVEN) if cfg == "UNEVEN" else MoHDiTTransformer2DModel.from_preset(
        cfg, sample_size=8)
    randomize(model).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, model.config.in_channels, 8, 8, generator=gen)
    t = torch.randint(0, 1000, (batch,), generator=gen)
    y = torch.randint(0, model.config.num_classes, (batch,), generator=gen)
    return model, x, t, y


@pytest.mark.parametrize("cfg", ["UNEVEN", "MoH-DiT-Tiny"])
def test_model_switch_at_several_ratios(randomize, cfg, monkeypatch):
    """``set_sparse_inference(True)`` puts the sparse processor on every MoH layer, which skips
    heads in every layer with some to skip; ``False`` puts the dense-masked one back. Same outputs
    at every ratio."""
    import moh_dit.models.sparse as sparse_module

    calls, real = [], sparse_module.per_head_attention
    monkeypatch.setattr(sparse_module, "per_head_attention", lambda *a: calls.append(1) or real(*a))
    model, x, t, y = model_and_inputs(randomize, cfg)
    for ratio in (None, 1.0, 0.9, model.head_activation_range[0]):
        model.set_head_activation_ratio(ratio)
        with torch.no_grad():
            model.set_sparse_inference(False)
            dense = model(x, t, y).sample
            model.set_sparse_inference(True)
            calls.clear()
            sparse = model(x, t, y).sample
        assert rel_err(sparse, dense) <= 1e-5, ratio
        skipping = [b for b in model.transformer_blocks if b.attn1.top_k < b.attn1.num_routed_heads]
        assert len(calls) == len(skipping) and (ratio == 1.0 or calls)
    model.set_sparse_inference(False)
    assert all(type(b.attn1.processor) is MoHAttnProcessor for b in model.transformer_blocks)


def test_sparse_gradients_equal_dense(randomize):
    model, x, t, y = model_and_inputs(randomize)
    x.requires_grad_(True)

    def grads(sparse):
        model.zero_grad(set_to_none=True)
        x.grad = None
        model.set_sparse_inference(sparse)
        out = model(x, t, y, output_load_balance_loss=True)
        (out.sample.square().mean() + 0.01 * out.load_balance_loss).backward()
        # The sparse path leaves out the K bias (softmax cancels it): no gradient = zero.
        named = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        return {**named, "x": x.grad.clone()}

    dense, sparse = grads(False), grads(True)
    assert dense["transformer_blocks.1.attn1.router_routed.weight"].abs().sum() > 0
    for name in dense:
        assert torch.allclose(sparse[name], dense[name], rtol=1e-4, atol=1e-6), name
    assert dense["transformer_blocks.1.attn1.to_k.bias"].abs().max() < 1e-6


def test_ideal_flop_ratio():
    ratio = reference.ideal_flop_ratio
    assert ratio(1024, 1152, 1152, 1.0) == pytest.approx(1.0)
    # dense per token: 8 D Din + 4 N Din; sparse at r = 0.5: 6 D Din + 2 N Din
    assert ratio(1024, 1152, 1152, 0.5) == pytest.approx((6 * 1152 + 2 * 1024) / (8 * 1152 + 4 * 1024))
    assert ratio(256, 768, 768, 0.0) == pytest.approx(4 * 768 / (8 * 768 + 4 * 256))  # K, V only
