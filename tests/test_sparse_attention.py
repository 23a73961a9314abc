"""Head-sparse MoH inference against the dense-masked path and a loop reference."""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import moh_dit
import moh_dit.models.attention as attention
import moh_dit.models.sparse_attention as sparse_attention
import moh_dit.models.transformer_moh_dit as transformer
from moh_dit import PRESETS, MoHDiTTransformer2DModel, top_k_for_ratio
from moh_dit.models.attention import MoHAttention, MoHAttnProcessor, MoHRouting
from moh_dit.models.fast_paths import SparseInferencePolicy
from moh_dit.models.sparse_attention import MoHSparseAttnProcessor

import reference_attention as reference  # test-only helpers (tests/ is on pytest's pythonpath)
ideal_flop_ratio, sparse_attention_reference = reference.ideal_flop_ratio, reference.sparse_attention_reference

DENSE = MoHAttnProcessor()
# dense_above=1.0: always skip, so that dense layouts really test the sparse computation.
SPARSE = MoHSparseAttnProcessor(dense_above=1.0)

pytestmark = pytest.mark.usefixtures("one_thread")


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def layer(h, hs, k, dim=16, head_dim=4, seed=0):
    torch.manual_seed(seed)
    attn = MoHAttention(dim, h, head_dim, hs, k).eval()
    with torch.no_grad():  # non-zero biases everywhere, so a missed or doubled bias shows
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return attn


def crafted_routing(attn, batch, tokens, allowed, seed=0):
    """A top-K decision that only ever picks routed heads in ``allowed`` (so the others
    are used by no token), with random positive gates; dense gates consistent with it."""
    gen = torch.Generator().manual_seed(seed)
    hs, e, k = attn.num_shared_heads, attn.num_routed_heads, attn.top_k
    scores = torch.rand(batch, tokens, e, generator=gen)
    scores[..., [j for j in range(e) if j not in allowed]] = -1.0
    routed_index = scores.topk(k, dim=-1).indices  # (B, N, K)
    routed_gates = torch.rand(batch, tokens, k, generator=gen) + 0.1
    gates = torch.cat(
        [torch.rand(batch, tokens, hs, generator=gen) + 0.1,
         torch.zeros(batch, tokens, e).scatter(-1, routed_index, routed_gates)], dim=-1
    )
    return MoHRouting(gates, routed_index, routed_gates)


# Every (h, hs, K) with hs = 0, 1, many and K = 1 .. h - hs for small h.
LAYOUTS = [(h, hs, k) for h in (3, 5) for hs in range(h) for k in range(1, h - hs + 1)]


@pytest.mark.parametrize("h, hs, k", LAYOUTS)
def test_sparse_equals_dense_masked_fp32(h, hs, k):
    attn = layer(h, hs, k)
    for batch, tokens in [(1, 1), (1, 9), (3, 1), (3, 17)]:
        x = torch.randn(batch, tokens, 16)
        with torch.no_grad():
            routing = attn.route(x)
            ref = DENSE(attn, x, routing)
            assert rel_err(SPARSE(attn, x, routing), ref) <= 1e-5, (batch, tokens)


@pytest.mark.parametrize("h, hs, k", [(3, 0, 1), (5, 1, 2), (5, 2, 3), (6, 0, 5)])
def test_loop_reference_matches_dense_masked(h, hs, k):
    attn = layer(h, hs, k)
    x = torch.randn(2, 11, 16)
    with torch.no_grad():
        routing = attn.route(x)
        assert rel_err(sparse_attention_reference(attn, x, routing), DENSE(attn, x, routing)) <= 1e-5


@pytest.mark.parametrize(
    "h, hs, k, allowed",
    [(6, 0, 1, [2]), (6, 0, 2, [0, 5]), (7, 2, 2, [1, 3, 4]), (7, 1, 1, [4]), (8, 3, 3, [0, 1, 2, 3])],
)
def test_heads_that_no_token_selects(h, hs, k, allowed):
    attn = layer(h, hs, k)
    for batch, tokens in [(1, 1), (2, 13)]:
        x = torch.randn(batch, tokens, 16)
        routing = crafted_routing(attn, batch, tokens, allowed)
        with torch.no_grad():
            ref = DENSE(attn, x, routing)
            assert rel_err(SPARSE(attn, x, routing), ref) <= 1e-5
            assert rel_err(sparse_attention_reference(attn, x, routing), ref) <= 1e-5


def test_many_blocks_per_head():
    """The Q and output projections gather and scatter in blocks of rows; force several."""
    small = MoHSparseAttnProcessor(dense_above=1.0, block_bytes=3 * 16 * 4)  # 3 rows of D = 16 floats
    for h, hs, k in [(6, 0, 2), (7, 2, 3)]:
        attn = layer(h, hs, k)
        x = torch.randn(3, 23, 16)
        with torch.no_grad():
            routing = attn.route(x)
            assert rel_err(small(attn, x, routing), DENSE(attn, x, routing)) <= 1e-5


def test_without_biases():
    torch.manual_seed(0)
    attn = MoHAttention(16, 6, 4, 2, 2, bias=False).eval()
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        routing = attn.route(x)
        assert rel_err(SPARSE(attn, x, routing), DENSE(attn, x, routing)) <= 1e-5


def _preset_layouts():
    """Distinct (h, hs, K) of every MoH preset, at its trained top-K and at the top-K that
    ``set_head_activation_ratio`` picks for other ratios."""
    found = set()
    for name, cfg in PRESETS.items():
        if cfg.get("num_shared_heads") is None:
            continue
        layers = cfg["num_layers"]
        heads = cfg["num_attention_heads"]
        heads = heads if isinstance(heads, list) else [heads] * layers
        shared = cfg["num_shared_heads"]
        lowest = (sum(shared) + sum(1 for h, s in zip(heads, shared) if s == 0 and h > s)) / sum(heads)
        for ratio in (None, 1.0, 0.95, 0.9, 0.8, 0.75, 0.65, 0.5, lowest):
            if ratio is not None and ratio < lowest:
                continue
            k = cfg["top_k"] if ratio is None else top_k_for_ratio(heads, shared, cfg["top_k"], ratio)
            found.update(zip(heads, shared, k))
    return sorted(found)


def test_every_preset_layout_and_ratio():
    layouts = _preset_layouts()
    assert (24, 16, 3) in layouts and (24, 14, 10) in layouts and (16, 8, 1) in layouts
    for i, (h, hs, k) in enumerate(layouts):
        attn = layer(h, hs, k, dim=24, head_dim=2, seed=i)
        x = torch.randn(2, 16, 24)
        with torch.no_grad():
            routing = attn.route(x)
            ref = DENSE(attn, x, routing)
            assert rel_err(SPARSE(attn, x, routing), ref) <= 1e-5, (h, hs, k)


@pytest.mark.parametrize("h, hs, k", [(6, 0, 2), (6, 2, 1), (5, 1, 3)])
def test_bf16(h, hs, k):
    attn = layer(h, hs, k)
    x = torch.randn(3, 20, 16)
    with torch.no_grad():
        routing = attn.route(x)
        exact = DENSE(attn, x, routing)
        attn_bf16 = attn.to(torch.bfloat16)
        x_bf16 = x.bfloat16()
        dense = DENSE(attn_bf16, x_bf16, routing)
        sparse = SPARSE(attn_bf16, x_bf16, routing)
        assert sparse.dtype == torch.bfloat16
        # bf16 keeps 8 mantissa bits: both paths are <1e-2 from fp32, and that close to each other.
        assert rel_err(sparse, dense) <= 2e-2
        assert rel_err(sparse, exact) <= 2e-2
    assert rel_err(dense, exact) > 1e-4  # bf16 really ran


def test_autocast_computes_dense_masked():
    """Under autocast the projections change dtype; the layer then
    returns exactly the dense-masked result instead of mixing dtypes in the in-place
    kernels, and the processor called directly refuses rather than computing wrongly."""
    attn = layer(6, 1, 2)
    attn.sparse_inference = True
    x = torch.randn(2, 12, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        routing = attn.route(x)
        ref = DENSE(attn, x, routing)
        assert ref.dtype == torch.bfloat16
        assert not attn.uses_sparse_processor(12, x.device)
        attn.sparse_processor = SPARSE
        assert torch.equal(attn(x), ref)
        with pytest.raises(ValueError, match="autocast"):
            SPARSE(attn, x, routing)
    assert attn.uses_sparse_processor(12, x.device)  # outside autocast it skips again


# ------------------------------------------------------------------ the model switch
UNEVEN = dict(
    sample_size=8, patch_size=2, in_channels=4, hidden_size=48, num_layers=4, attention_head_dim=12,
    num_attention_heads=[2, 4, 6, 5], num_shared_heads=[2, 0, 4, 1], top_k=[0, 2, 1, 3], num_classes=7,
)


def model_and_inputs(randomize, cfg="UNEVEN", batch=3):
    model = MoHDiTTransformer2DModel(**UNEVEN) if cfg == "UNEVEN" else MoHDiTTransformer2DModel.from_preset(cfg, sample_size=8)
    randomize(model).eval()
    for block in model.transformer_blocks:  # skip even at high routed density
        block.attn1.sparse_processor = MoHSparseAttnProcessor(dense_above=1.0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, model.config.in_channels, 8, 8, generator=gen)
    t = torch.randint(0, 1000, (batch,), generator=gen)
    y = torch.randint(0, model.config.num_classes, (batch,), generator=gen)
    return model, x, t, y


class Spy:
    def __init__(self, processor):
        self.processor, self.calls = processor, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.processor(*args, **kwargs)


def spy_sparse(model):
    spies = []
    for block in model.transformer_blocks:
        block.attn1.sparse_processor = Spy(block.attn1.sparse_processor)
        spies.append(block.attn1.sparse_processor)
    return lambda: sum(s.calls for s in spies)


@pytest.mark.parametrize("cfg", ["UNEVEN", "MoH-DiT-Tiny"])
def test_model_sparse_equals_dense_at_several_ratios(randomize, cfg):
    model, x, t, y = model_and_inputs(randomize, cfg)
    lowest = model.head_activation_range[0]
    for ratio in (None, 1.0, 0.9, lowest):
        model.set_head_activation_ratio(ratio)
        with torch.no_grad():
            model.set_sparse_inference(False)
            dense = model(x, t, y).sample
            model.set_sparse_inference(True)
            sparse = model(x, t, y).sample
        assert rel_err(sparse, dense) <= 1e-5, ratio
    single = model_and_inputs(randomize, cfg, batch=1)
    with torch.no_grad():
        model.set_sparse_inference(False)
        dense = model(*single[1:]).sample
        model.set_sparse_inference(True)
        assert rel_err(model(*single[1:]).sample, dense) <= 1e-5


def test_auto_mode_keeps_small_or_dense_layers_masked(randomize):
    """With the default thresholds a tiny model, or a layer with most heads active, stays on
    the dense-masked path in automatic mode (skipping would cost more than it saves)."""
    model, x, t, y = model_and_inputs(randomize)
    sparse_calls = spy_sparse(model)
    model.eval().set_sparse_inference(None)
    with torch.no_grad():
        model(x, t, y)
    assert sparse_calls() == 0
    attn = model.transformer_blocks[1].attn1
    assert not attn.uses_sparse_processor(tokens=10**6) or (attn.num_shared_heads + attn.top_k) / attn.heads <= 0.5


def test_path_selection(randomize):
    model, x, t, y = model_and_inputs(randomize)
    anywhere = SparseInferencePolicy(max_active=1.0, min_work=0)  # any density and size, CPU only
    model.set_sparse_inference(None, policy=anywhere)
    routed_layers = sum(1 for h, s in zip(model.layer_heads, model.layer_shared) if h > s)
    sparse_calls = spy_sparse(model)

    def calls(train, grad, setting):
        model.train(train).set_sparse_inference(setting)
        before = sparse_calls()
        with torch.set_grad_enabled(grad):
            model(x, t, y)
        return sparse_calls() - before

    assert calls(False, False, None) == routed_layers  # auto: eval without autograd
    assert calls(False, True, None) == 0  # autograd on: dense-masked (router gradients)
    assert calls(True, False, None) == 0  # training never
    assert calls(True, True, True) == 0
    assert calls(False, True, True) == routed_layers  # forced
    assert calls(False, False, False) == 0
    model.eval().set_sparse_inference(None)
    attn = model.transformer_blocks[1].attn1
    with torch.no_grad():  # automatic mode takes the sparse path on the CPU only
        assert attn.uses_sparse_processor(64, torch.device("cpu"))
        assert not attn.uses_sparse_processor(64, torch.device("cuda"))
    model.set_sparse_inference(None, policy=dataclasses.replace(anywhere, devices=()))
    assert calls(False, False, None) == 0  # the forward passes its input's device
    model.set_sparse_inference(None, policy=anywhere)
    with pytest.raises(ValueError, match="True, False or None"):
        model.set_sparse_inference("yes")
    model.eval().set_sparse_inference(None)
    model.transformer_blocks[1].attn1.set_processor(Spy(MoHAttnProcessor()))
    before = sparse_calls()
    with torch.no_grad():
        model(x, t, y)
    assert sparse_calls() - before == routed_layers - 1  # a user's own processor is respected


def test_sparse_gradients_equal_dense(randomize):
    model, x, t, y = model_and_inputs(randomize)

    def grads(setting):
        model.zero_grad(set_to_none=True)
        model.set_sparse_inference(setting)
        out = model(x, t, y, output_load_balance_loss=True)
        (out.sample.square().mean() + 0.01 * out.load_balance_loss).backward()
        # The sparse path leaves out the K bias (softmax cancels it): no gradient = zero.
        return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}

    dense, sparse = grads(False), grads(True)
    assert dense["transformer_blocks.1.attn1.router_routed.weight"].abs().sum() > 0
    for name in dense:
        assert torch.allclose(sparse[name], dense[name], rtol=1e-4, atol=1e-6), name
    assert dense["transformer_blocks.1.attn1.to_k.bias"].abs().max() < 1e-6


@pytest.mark.slow
def test_compiled_eval_without_grad_has_no_graph_breaks(randomize):
    """Auto mode keeps torch.compile on the dense-masked path (the sparse one has
    data-dependent shapes)."""
    model, x, t, y = model_and_inputs(randomize, "MoH-DiT-Tiny")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(x, t, y).sample
        assert rel_err(out, model(x, t, y).sample) <= 1e-5


def test_sparse_path_in_the_model_and_its_gradients(randomize):
    """The head-sparse path through the model switch (ratio changes included), and its
    gradients, equal the dense-masked ones."""
    model, x, t, y = model_and_inputs(randomize)
    for block in model.transformer_blocks:
        block.attn1.sparse_processor = MoHSparseAttnProcessor(dense_above=1.0)
    for ratio in (None, model.head_activation_range[0]):
        model.set_head_activation_ratio(ratio)
        with torch.no_grad():
            model.set_sparse_inference(False)
            dense = model(x, t, y).sample
            model.set_sparse_inference(True)
            assert rel_err(model(x, t, y).sample, dense) <= 1e-5, ratio
    model.set_head_activation_ratio(None)
    x.requires_grad_(True)
    grads = []
    for setting in (False, True):
        model.set_sparse_inference(setting)
        x.grad = None
        model(x, t, y).sample.square().mean().backward()
        grads.append(x.grad.clone())
    assert torch.allclose(grads[1], grads[0], rtol=1e-4, atol=1e-7)


def test_bad_arguments_rejected():
    with pytest.raises(ValueError, match="dense_above"):
        MoHSparseAttnProcessor(dense_above=1.5)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="block_bytes"):
            MoHSparseAttnProcessor(block_bytes=bad)
    for kwargs, match in [
        (dict(max_active=1.5), "max_active"), (dict(max_active=-0.1), "max_active"),
        (dict(min_work=-1), "min_work"), (dict(devices="cpu"), "devices"), (dict(devices=(1,)), "devices"),
    ]:
        with pytest.raises(ValueError, match=match):
            SparseInferencePolicy(**kwargs)
    model = MoHDiTTransformer2DModel(**UNEVEN)
    with pytest.raises(ValueError, match="SparseInferencePolicy"):
        model.set_sparse_inference(None, policy={"max_active": 1.0})


def test_policy_thresholds_are_per_model(randomize):
    """Automatic mode's thresholds are arguments: one model's policy changes its own layers
    only, and the defaults are the documented ones."""
    assert SparseInferencePolicy() == SparseInferencePolicy(0.5, 256 * 768, ("cpu",))
    model, x, t, y = model_and_inputs(randomize)
    other, *_ = model_and_inputs(randomize)
    model.set_sparse_inference(None, policy=SparseInferencePolicy(max_active=1.0, min_work=0))
    with torch.no_grad():
        assert model.transformer_blocks[1].attn1.uses_sparse_processor(16, torch.device("cpu"))
        assert not other.transformer_blocks[1].attn1.uses_sparse_processor(16, torch.device("cpu"))
    model.set_sparse_inference(True)  # None leaves the policy as it is
    assert model.transformer_blocks[1].attn1.sparse_policy.min_work == 0


def test_sparse_module_never_imports_the_model():
    """The attention and the model import the sparse module, not the other way round: nothing
    the sparse module imports, directly or through other package modules (inside functions
    and under TYPE_CHECKING too), is the model or attention file; and the names that moved
    still import from every public place."""
    package = Path(sparse_attention.__file__).parent
    seen, todo = set(), ["sparse_attention"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(ast.parse((package / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                todo.append(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.level == 1:
                todo.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moh_dit"):
                todo.append((node.module.split(".") + [""])[1] or "__init__")
        todo = [t for t in todo if (package / f"{t}.py").is_file()]
    assert not {"transformer_moh_dit", "attention", "__init__"} & seen, sorted(seen)
    assert moh_dit.MoHRouting is transformer.MoHRouting is MoHRouting


def test_dense_above_threshold():
    processor = MoHSparseAttnProcessor(dense_above=0.5)
    assert processor.skips_heads(layer(6, 2, 2))  # 2 of 4 routed heads
    assert not processor.skips_heads(layer(6, 2, 3))  # 3 of 4: run dense-masked
    assert not processor.skips_heads(layer(6, 2, 4))  # all selected: nothing to skip
    assert not processor.skips_heads(layer(4, 4, 0))  # no routed heads
    attn = layer(6, 2, 3)
    attn.sparse_processor, attn.sparse_inference = processor, True
    assert not attn.uses_sparse_processor(9, torch.device("cpu"))  # the layer decides, once
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        out = attn(x)
        assert torch.equal(out, DENSE(attn, x, attn.routing))


def test_ideal_flop_ratio():
    assert ideal_flop_ratio(1024, 1152, 1152, 1.0) == pytest.approx(1.0)
    # dense per token: 8 D Din + 4 N Din; sparse at r = 0.5: 6 D Din + 2 N Din
    assert ideal_flop_ratio(1024, 1152, 1152, 0.5) == pytest.approx((6 * 1152 + 2 * 1024) / (8 * 1152 + 4 * 1024))
    assert ideal_flop_ratio(256, 768, 768, 0.0) == pytest.approx(4 * 768 / (8 * 768 + 4 * 256))  # K, V only


# --------------------------------------------------------------------------------------
# The fused QKV + router GEMM (moh_dit.models.fast_paths)
# --------------------------------------------------------------------------------------


def _fused_and_separate(attn, x, need_stats):
    """(output, routing, gradients) of one forward + backward with and without the fused GEMM."""
    results = []
    for fused in (True, False):
        attn.fused_projections = fused
        attn.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out, routing = attn(xi), attn.routing
        loss = out.square().sum() + (routing.load_balance_loss if routing is not None and need_stats
                                     and routing.load_balance_loss is not None else 0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in attn.named_parameters()}
        results.append((out.detach(), routing, grads, xi.grad))
    return results


@pytest.mark.parametrize("heads, shared, k, gate_mode", [
    (6, 2, 2, "release"), (6, 0, 3, "release"), (6, 1, 2, "release"), (4, 4, 0, "release"),
    (6, 2, 2, "paper"), (4, None, None, "release"),  # the last one: a dense layer (QKV fused alone)
])
def test_fused_projection_equals_separate_linears_with_gradients(heads, shared, k, gate_mode):
    torch.manual_seed(0)
    attn = MoHAttention(48, heads, 8, shared, k, gate_mode).train()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 10, 48)
    (out_f, rt_f, g_f, xg_f), (out_s, rt_s, g_s, xg_s) = _fused_and_separate(attn, x, need_stats=True)
    def close(a, b):  # float32 rounding, relative to the tensor's scale
        return (a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1e-6)

    assert close(out_f, out_s) and close(xg_f, xg_s)
    # against the largest gradient: to_k's bias has a zero gradient in exact arithmetic (a
    # softmax does not see a shift of every key's score), so both paths give rounding noise there
    scale = max(g.abs().max() for g in g_s.values())
    assert set(g_f) == set(g_s) and all((g_f[n] - g_s[n]).abs().max() <= 1e-5 * scale for n in g_s)
    if shared is not None:
        assert torch.allclose(rt_f.gates, rt_s.gates, atol=1e-6)
        assert torch.equal(rt_f.head_usage, rt_s.head_usage)
        if rt_s.load_balance_loss is not None:
            assert torch.allclose(rt_f.load_balance_loss, rt_s.load_balance_loss, atol=1e-6)


def test_fused_path_is_taken_and_wrapped_projections_fall_back(monkeypatch):
    calls = []
    real = attention.fused_projections
    monkeypatch.setattr(attention, "fused_projections", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    torch.manual_seed(0)
    attn = MoHAttention(48, 6, 8, 2, 2).eval()
    attn.fused_projections = True  # forced: the default fuses on CUDA only
    x = torch.randn(2, 10, 48)
    with torch.no_grad():
        attn.sparse_inference = False
        expected = attn(x)
    assert calls == [1]

    class Wrapped(torch.nn.Linear):  # what a LoRA layer looks like to the model: not a plain Linear
        pass

    wrapped = Wrapped(48, 48)
    wrapped.load_state_dict(attn.to_q.state_dict())
    attn.to_q = wrapped
    with torch.no_grad():
        out = attn(x)
    assert calls == [1] and torch.allclose(out, expected, atol=1e-5)


def test_cached_fused_weight_follows_weight_changes():
    """In no-grad inference the stacked weight is cached; any change to a weight (in place,
    load_state_dict, a dtype move) is seen on the next call."""
    torch.manual_seed(0)
    attn = MoHAttention(48, 6, 8, 2, 2).eval()
    attn.sparse_inference = False
    attn.fused_projections = True  # forced: the default fuses on CUDA only
    x = torch.randn(2, 10, 48)
    with torch.no_grad():
        first = attn(x)
        attn.router_routed.weight.mul_(-3.0)
        attn.to_v.bias.add_(1.0)
        changed = attn(x)
        attn.fused_projections = False
        separate = attn(x)
    assert not torch.allclose(first, changed) and torch.allclose(changed, separate, atol=1e-5)
    attn.fused_projections = True
    attn.to(torch.float64)
    with torch.no_grad():
        assert attn(x.double()).dtype == torch.float64


def test_fused_projections_default_to_cuda_only():
    """By default the one-GEMM path runs on CUDA; on the CPU the separate linears run, so CPU
    results (and the demo's documented numbers) are bit-identical to the unfused layer."""
    torch.manual_seed(0)
    attn = MoHAttention(48, 6, 8, 2, 2)
    attn.sparse_inference = False
    assert attn.fused_projections is None
    x = torch.randn(2, 10, 48)
    default = attn(x)
    attn.fused_projections = False
    separate = attn(x)
    attn.fused_projections = True
    fused = attn(x)
    assert torch.equal(default, separate)
    assert torch.allclose(fused, separate, atol=1e-5)
