"""MoHDiTTransformer2DModel against an independent reference of the release math (written in plain
tensor operations on a release-format state dict, sharing no code with the package), its presets,
gates, head activation, and the diffusers habits (processors, fused projections, save/load)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moh_dit.hub.convert import model_to_release_state_dict, release_state_dict_to_model
from moh_dit.models import (PRESETS, HeadLayout, MoHAttention, MoHAttnProcessor, MoHDiTTransformer2DModel, MoHRouting,
                            head_activation, preset_names, top_k_for_ratio)

# A layout with per-layer head counts and inner width != hidden (like XL), every gate case.
UNEVEN = dict(
    sample_size=8, patch_size=2, in_channels=4, hidden_size=48, num_layers=4, attention_head_dim=12,
    num_attention_heads=[2, 4, 6, 5], num_shared_heads=[2, 0, 4, 1], top_k=[0, 2, 1, 3], num_classes=7,
)


# ------------------------------------------------------------------ reference (release)
def ref_gates(x, sd, prefix, h, hs, k, mode="release"):
    """Per-head gates (B, N, h) and the layer's load-balance loss, from docs/design.md."""
    release = mode == "release"
    B, N, _ = x.shape
    e = h - hs
    g_shared = None
    if hs > 1:
        g_shared = torch.softmax(x @ sd[prefix + "wg_1.weight"].T, dim=-1) * (hs if release else 1)
    elif hs == 1:
        g_shared = torch.ones(B, N, 1)
    if e == 0:
        return g_shared, None
    p = torch.softmax(x @ sd[prefix + "wg.weight"].T, dim=-1)  # (B, N, E)
    order = torch.argsort(p, dim=-1, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep.scatter_(-1, order[..., :k], True)
    kept = torch.where(keep, p, torch.zeros_like(p))
    g_routed = k * kept / kept.sum(-1, keepdim=True) if release else kept
    if hs > 0:
        a = torch.softmax(x @ sd[prefix + "wg_0.weight"].T, dim=-1) * (2 if release else 1)
        g_shared = g_shared * a[..., :1]
        g_routed = g_routed * a[..., 1:]
    P = p.reshape(-1, e).mean(0)
    f = keep.float().reshape(-1, e).mean(0)
    lb = e * (P * f).sum()
    gates = g_routed if g_shared is None else torch.cat([g_shared, g_routed], -1)
    return gates, lb


def ref_forward(sd, cfg, x, t, y, top_k=None, mode="release"):
    """The release DiT/MoH-DiT forward from docs/design.md (fp32)."""
    p, D = cfg["patch_size"], cfg["hidden_size"]
    L = cfg["num_layers"]
    heads = cfg["num_attention_heads"]
    heads = heads if isinstance(heads, list) else [heads] * L
    shared = cfg.get("num_shared_heads")
    top_k = top_k or cfg.get("top_k")
    d = cfg["attention_head_dim"]
    B = x.shape[0]
    h = F.conv2d(x, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=p)
    h = h.flatten(2).transpose(1, 2) + sd["pos_embed"]
    freqs = torch.exp(-math.log(10000.0) * torch.arange(128, dtype=torch.float32) / 128)
    ang = t.float()[:, None] * freqs[None]
    temb = torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)
    temb = F.linear(F.silu(F.linear(temb, sd["t_embedder.mlp.0.weight"], sd["t_embedder.mlp.0.bias"])),
                    sd["t_embedder.mlp.2.weight"], sd["t_embedder.mlp.2.bias"])
    c = temb + sd["y_embedder.embedding_table.weight"][y]
    lbs = []
    for i in range(L):
        pre = f"blocks.{i}."
        mod = F.linear(F.silu(c), sd[pre + "adaLN_modulation.1.weight"], sd[pre + "adaLN_modulation.1.bias"])
        s1, c1, g1, s2, c2, g2 = mod.chunk(6, dim=1)
        a_in = F.layer_norm(h, (D,), eps=1e-6) * (1 + c1[:, None]) + s1[:, None]
        N = a_in.shape[1]
        qkv = F.linear(a_in, sd[pre + "attn.qkv.weight"], sd[pre + "attn.qkv.bias"])
        qkv = qkv.reshape(B, N, 3, heads[i], d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = torch.softmax((q * d**-0.5) @ k.transpose(-2, -1), dim=-1) @ v  # (B, h, N, d)
        if shared is not None:
            gates, lb = ref_gates(a_in, sd, pre + "attn.", heads[i], shared[i], top_k[i], mode)
            att = att * gates.permute(0, 2, 1)[..., None]
            if lb is not None:
                lbs.append(lb)
        o = F.linear(att.transpose(1, 2).reshape(B, N, -1), sd[pre + "attn.proj.weight"], sd[pre + "attn.proj.bias"])
        h = h + g1[:, None] * o
        m_in = F.layer_norm(h, (D,), eps=1e-6) * (1 + c2[:, None]) + s2[:, None]
        m = F.linear(F.gelu(F.linear(m_in, sd[pre + "mlp.fc1.weight"], sd[pre + "mlp.fc1.bias"]), approximate="tanh"),
                     sd[pre + "mlp.fc2.weight"], sd[pre + "mlp.fc2.bias"])
        h = h + g2[:, None] * m
    shift, scale = F.linear(F.silu(c), sd["final_layer.adaLN_modulation.1.weight"],
                            sd["final_layer.adaLN_modulation.1.bias"]).chunk(2, dim=1)
    h = F.layer_norm(h, (D,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    h = F.linear(h, sd["final_layer.linear.weight"], sd["final_layer.linear.bias"])
    s = int(math.isqrt(h.shape[1]))
    c_out = h.shape[-1] // (p * p)
    h = h.reshape(B, s, s, p, p, c_out).permute(0, 5, 1, 3, 2, 4).reshape(B, c_out, s * p, s * p)
    return h, (torch.stack(lbs).mean() if lbs else None)


def dit_pos_embed(dim, grid):
    """DiT's 2-D sin-cos table in float64 (numpy), written from the DiT paper's description."""
    def one_d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    gw, gh = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64))
    return np.concatenate([one_d(dim // 2, gw), one_d(dim // 2, gh)], axis=1)


def make(cfg_or_name, randomize, seed=0, **overrides):
    if isinstance(cfg_or_name, str):
        model = MoHDiTTransformer2DModel.from_preset(cfg_or_name, **overrides)
    else:
        model = MoHDiTTransformer2DModel(**{**cfg_or_name, **overrides})
    return randomize(model, seed=seed).eval()


def inputs(model, batch=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    c, s = model.config.in_channels, model.config.sample_size
    x = torch.randn(batch, c, s, s, generator=gen)
    t = torch.randint(0, 1000, (batch,), generator=gen)
    y = torch.randint(0, model.config.num_classes + 1, (batch,), generator=gen)
    return x, t, y


def ratio_of(name):
    return HeadLayout.of_config(PRESETS[name]).activation_ratio()


# ------------------------------------------------------------------ presets
@pytest.mark.parametrize(
    "name, params",
    [("MoH-DiT-XL/2-90", 675_666_464), ("MoH-DiT-L/2-90", 458_512_416), ("MoH-DiT-B/2-90", 130_638_368),
     ("MoH-DiT-S/2-90", 32_997_152), ("DiT-XL/2", 675_129_632), ("DiT-L/2", 458_102_816),
     ("DiT-B/2", 130_512_416), ("DiT-S/2", 32_963_360)],
)
def test_preset_parameter_counts_match_release(name, params):
    with torch.device("meta"):
        model = MoHDiTTransformer2DModel.from_preset(name)
    # The release stores its fixed pos_embed as a parameter; ours is a buffer.
    assert sum(p.numel() for p in model.parameters()) + model.pos_embed.pos_embed.numel() == params


@pytest.mark.parametrize(
    "name, ratio",
    [("MoH-DiT-XL/2-90", 403 / 448), ("MoH-DiT-XL/2-75", 336 / 448), ("MoH-DiT-L/2-90", 344 / 384),
     ("MoH-DiT-L/2-75", 288 / 384), ("MoH-DiT-B/2-90", 129 / 144), ("MoH-DiT-B/2-75", 108 / 144),
     ("MoH-DiT-S/2-90", 64 / 72), ("MoH-DiT-S/2-75", 54 / 72), ("MoH-DiT-Tiny", 0.75), ("DiT-XL/2", 1.0),
     ("MoH-DiT-XL/2-up90", 403 / 448), ("MoH-DiT-Tiny-up90", 22 / 24)],
)
def test_preset_activation_ratio(name, ratio):
    assert ratio_of(name) == pytest.approx(ratio, abs=1e-12) and name in preset_names()
    if "Tiny" in name:
        assert MoHDiTTransformer2DModel.from_preset(name).head_activation_ratio == pytest.approx(ratio)


def test_from_preset_copies_the_preset():
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, num_classes=3)
    assert model.config.sample_size == 8 and PRESETS["MoH-DiT-Tiny"]["sample_size"] == 32
    with pytest.raises(ValueError, match="MoH-DiT-XL/2-90"):
        MoHDiTTransformer2DModel.from_preset("MoH-DiT-XXL/2")


# ------------------------------------------------------------------ equivalence with the release
@pytest.mark.parametrize("cfg", ["MoH-DiT-Tiny", "DiT-Tiny", "UNEVEN"])
def test_forward_matches_release_reference(cfg, randomize):
    model = make(UNEVEN if cfg == "UNEVEN" else cfg, randomize, sample_size=8)
    x, t, y = inputs(model)
    sd = model_to_release_state_dict(model)
    out = model(x, t, y, output_load_balance_loss=True)
    ref, ref_lb = ref_forward(sd, dict(model.config), x, t, y)
    assert out.sample.shape == (3, 2 * model.config.in_channels, 8, 8)
    assert (out.sample - ref).abs().max() <= 1e-5
    if model.is_moh:
        assert out.load_balance_loss.item() == pytest.approx(ref_lb.item(), abs=1e-6)
    else:
        assert out.load_balance_loss.item() == 0.0


def test_release_state_dict_loads_into_model(randomize):
    """Direction release -> model: random weights in the release key format."""
    donor = make(UNEVEN, randomize, seed=3)
    sd = {k: torch.randn_like(v) * 0.1 for k, v in model_to_release_state_dict(donor).items()}
    sd["pos_embed"] = model_to_release_state_dict(donor)["pos_embed"]
    model = MoHDiTTransformer2DModel(**UNEVEN).eval()
    release_state_dict_to_model(sd, model)
    x, t, y = inputs(model)
    ref, _ = ref_forward(sd, UNEVEN, x, t, y)
    assert (model(x, t, y).sample - ref).abs().max() <= 1e-5
    back = model_to_release_state_dict(model)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_paper_gate_mode_matches_reference(randomize):
    model = make(UNEVEN, randomize, gate_mode="paper")
    x, t, y = inputs(model)
    ref, _ = ref_forward(model_to_release_state_dict(model), UNEVEN, x, t, y, mode="paper")
    assert (model(x, t, y).sample - ref).abs().max() <= 1e-5
    assert (make(UNEVEN, randomize)(x, t, y).sample - ref).abs().max() > 1e-3  # the modes really differ


def test_pos_embed_and_timestep_embedding_follow_dit():
    model = MoHDiTTransformer2DModel.from_preset("DiT-Tiny")
    assert np.abs(model.pos_embed.pos_embed[0].numpy() - dit_pos_embed(128, 8)).max() < 1e-5
    t = torch.tensor([0, 1, 17, 999])
    freqs = torch.exp(-math.log(10000.0) * torch.arange(128, dtype=torch.float64) / 128)
    ang = t[:, None].double() * freqs
    expected = torch.cat([torch.cos(ang), torch.sin(ang)], -1)
    assert (model.time_class_embed.time_proj(t).double() - expected).abs().max() < 1e-4


def test_dit_initialization():
    """Zero adaLN and output layers (every block starts as the identity), DiT's N(0, 0.02) label
    table, and the demo preset's unit-scale one."""
    torch.manual_seed(0)
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, num_classes=1000).eval()
    x, t, y = inputs(model)
    assert torch.count_nonzero(model(x, t, y).sample) == 0
    assert all(torch.count_nonzero(block.norm1.linear.weight) == 0 for block in model.transformer_blocks)
    table = model.time_class_embed.class_embedder.embedding_table.weight
    assert table.shape == (1001, 128) and float(table.detach().std()) == pytest.approx(0.02, rel=0.05)
    assert model.transformer_blocks[1].attn1.router_routed.weight.abs().sum() > 0
    demo = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny/2", num_classes=1000)
    assert float(demo.time_class_embed.class_embedder.embedding_table.weight.std()) == pytest.approx(1.0, rel=0.05)


# ------------------------------------------------------------------ gates
def _attention(h, hs, k, mode="release", seed=0):
    torch.manual_seed(seed)
    return MoHAttention(16, h, 8, hs, k, mode), torch.randn(2, 10, 16)


@pytest.mark.parametrize("h, hs, k", [(6, 2, 2), (6, 0, 3), (5, 1, 2), (4, 4, 0), (4, 3, 1), (3, 1, 1)])
def test_gate_invariants_release(h, hs, k):
    attn, x = _attention(h, hs, k)
    r = attn.route(x)
    g, routed = r.gates, r.gates[..., hs:]
    assert g.shape == (2, 10, h) and ((routed > 0).sum(-1) == k).all()  # exactly K routed heads per token
    if hs > 0 and k > 0:
        a = torch.softmax(attn.router_mix(x), -1) * 2
        assert torch.allclose(routed.sum(-1), k * a[..., 1], atol=1e-5)  # sum routed = K * a_1
        assert torch.allclose(g[..., :hs].sum(-1), hs * a[..., 0], atol=1e-5)  # sum shared = hs * a_0
        if hs == 1:  # no router_shared (the release crashes): a constant 1, times a_0
            assert attn.router_shared is None and torch.allclose(g[..., 0], a[..., 0], atol=1e-6)
    elif k > 0:
        assert torch.allclose(routed.sum(-1), torch.full((2, 10), float(k)), atol=1e-5)
    else:
        assert torch.allclose(g.sum(-1), torch.full((2, 10), float(hs)), atol=1e-5)
    if k:  # the selected routed heads are the top-K of the router probabilities
        p = torch.softmax(attn.router_routed(x), -1)
        mask = torch.zeros_like(p, dtype=torch.bool).scatter(-1, p.topk(k, -1).indices, True)
        assert torch.equal(mask, routed > 0)
    usage = r.head_usage
    assert torch.equal(usage[:hs], torch.ones(hs)) and usage[hs:].sum().item() == pytest.approx(k)


def test_load_balance_loss_hand_case():
    attn = MoHAttention(2, 3, 2, num_shared_heads=1, top_k=1)
    with torch.no_grad():
        attn.router_routed.weight.copy_(torch.eye(2))
    l3 = math.log(3.0)
    x = torch.tensor([[[l3, 0.0], [0.0, l3], [l3, 0.0], [l3, 0.0]]])
    # probs: [.75,.25], [.25,.75], [.75,.25], [.75,.25] -> P = [.625,.375], f = [.75,.25]
    # l = E * sum P f = 2 * (.625*.75 + .375*.25) = 1.125
    r = attn.route(x)
    assert r.load_balance_loss.item() == pytest.approx(1.125, abs=1e-6)
    assert torch.allclose(r.head_usage, torch.tensor([1.0, 0.75, 0.25]))
    # the gradient flows through P only (f is a count)
    attn.router_routed.weight.requires_grad_(True)
    (g_model,) = torch.autograd.grad(attn.route(x).load_balance_loss, attn.router_routed.weight)
    p = torch.softmax(x[0] @ attn.router_routed.weight.T, -1)
    (g_manual,) = torch.autograd.grad(2 * (p.mean(0) * torch.tensor([0.75, 0.25])).sum(), attn.router_routed.weight)
    assert torch.allclose(g_model, g_manual, atol=1e-7)


def test_load_balance_loss_is_k_at_perfect_balance():
    """Uniform router probabilities, each routed head in the top-K of the same share of tokens."""
    routed_index = torch.tensor([[[0, 1], [2, 3], [1, 2], [3, 0]]])  # (B, N, K): each head twice
    routing = MoHRouting(torch.ones(1, 4, 4), routed_index, torch.ones(1, 4, 2), torch.full((1, 4, 4), 0.25))
    assert routing.routed_usage.tolist() == [0.5] * 4 and routing.load_balance_loss.item() == pytest.approx(2.0)


def test_model_statistics(randomize):
    """The load-balance loss is the mean over the routed layers (in training by default); head
    usage per layer; no layer keeps its routing after the forward pass."""
    model = make("MoH-DiT-Tiny", randomize, sample_size=8)
    x, t, y = inputs(model)
    per_layer = []
    hooks = [b.attn1.register_forward_hook(lambda m, i, o: per_layer.append(m.routing.load_balance_loss))
             for b in model.transformer_blocks]
    out = model(x, t, y, output_load_balance_loss=True, output_head_usage=True)
    for hook in hooks:
        hook.remove()
    routed = [v for v in per_layer if v is not None]
    assert len(routed) == 5  # layer 0 is all-shared
    assert out.load_balance_loss.item() == pytest.approx(torch.stack(routed).mean().item(), abs=1e-6)
    for u, hs, k in zip(out.head_usage, model.layout.shared, model.top_k_per_layer):
        assert u.shape == (4,) and torch.all(u[:hs] == 1) and u[hs:].sum().item() == pytest.approx(k)
    assert all(block.attn1.routing is None for block in model.transformer_blocks)
    assert model(x, t, y).load_balance_loss is None and model.train()(x, t, y).load_balance_loss is not None
    dense = make("DiT-Tiny", randomize, sample_size=8)
    assert all(torch.all(u == 1) for u in dense(x, t, y, output_head_usage=True).head_usage)


# ------------------------------------------------------------------ head activation ratio
@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("MoH")])
def test_trained_ratio_gives_trained_top_k(name):
    layout = HeadLayout.of_config(PRESETS[name])
    heads, shared, trained = layout.heads, layout.shared, list(layout.top_k)
    assert layout.top_k_for_ratio(layout.activation_ratio()) == trained
    low, _ = layout.reachable_range()
    for r in (1.0, 0.95, 0.85, 0.8, 0.7):
        if r < low:
            continue
        k = top_k_for_ratio(heads, shared, trained, r)
        assert abs(layout.activation_ratio(k) - r) <= 0.5 / sum(heads) + 1e-12  # as close as any layout gets
        assert all(0 <= kk <= h - s for kk, h, s in zip(k, heads, shared))


def test_set_head_activation_ratio(randomize):
    model = make("MoH-DiT-Tiny", randomize, sample_size=8)
    x, t, y = inputs(model)
    base = model(x, t, y).sample
    assert model.set_head_activation_ratio(1.0) == 1.0 and model.top_k_per_layer == [0, 2, 2, 3, 2, 4]
    assert not torch.allclose(model(x, t, y).sample, base)
    assert model.head_activation_range == (0.5, 1.0)
    # the lowest ratio: a layer without shared heads keeps one routed head
    assert model.set_head_activation_ratio(0.5) == 0.5 and model.top_k_per_layer == [0, 0, 0, 0, 0, 1]
    for bad in (0.4, 1.2, float("nan")):
        with pytest.raises(ValueError, match=r"\[0.5000, 1.0000\]"):
            model.set_head_activation_ratio(bad)
    assert model.top_k_per_layer == [0, 0, 0, 0, 0, 1]  # a refused ratio changes nothing
    with head_activation(model, 0.9) as realised:
        assert realised == model.head_activation_ratio == pytest.approx(22 / 24)
        ref, _ = ref_forward(model_to_release_state_dict(model), dict(model.config), x, t, y,
                             top_k=model.top_k_per_layer)
        assert (model(x, t, y).sample - ref).abs().max() <= 1e-5  # the reference agrees at another top-K
    assert model.top_k_per_layer == [0, 0, 0, 0, 0, 1]  # given back
    with pytest.raises(RuntimeError), head_activation(model, 1.0):
        raise RuntimeError
    assert model.top_k_per_layer == [0, 0, 0, 0, 0, 1]
    assert model.set_head_activation_ratio(None) == 0.75 and torch.equal(model(x, t, y).sample, base)
    dense = MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8)
    assert dense.set_head_activation_ratio(None) == dense.set_head_activation_ratio(1.0) == 1.0
    with pytest.raises(ValueError):
        dense.set_head_activation_ratio(0.5)


def test_head_layout_is_parsed_once():
    layout = HeadLayout.of_config(PRESETS["MoH-DiT-Tiny"])
    assert layout == HeadLayout((4,) * 6, (4, 2, 2, 1, 2, 0), (0, 1, 1, 2, 1, 2)) and layout.is_moh
    assert layout.activation_ratio() == 0.75 and layout.reachable_range() == (0.5, 1.0)
    assert HeadLayout.of_config(PRESETS["DiT-Tiny"]) == HeadLayout((4,) * 6, None, None)
    for bad in (dict(top_k=[0, 0, 1, 3]), dict(num_shared_heads=[2, 7, 4, 1]), dict(top_k=[0, 2, 1]),
                dict(top_k=None), dict(gate_mode="printed")):
        with pytest.raises(ValueError):
            MoHDiTTransformer2DModel(**{**UNEVEN, **bad})


# ------------------------------------------------------------------ saving, training features
def test_save_load_roundtrip(tmp_path, randomize):
    model = make("MoH-DiT-Tiny", randomize, sample_size=8, class_names=[f"c{i}" for i in range(10)])
    model.save_pretrained(tmp_path / "m")
    loaded = MoHDiTTransformer2DModel.from_pretrained(tmp_path / "m").eval()
    public = lambda cfg: {k: v for k, v in cfg.items() if not k.startswith("_")}  # noqa: E731
    assert public(loaded.config) == public(model.config) and loaded.config.class_names[3] == "c3"
    x, t, y = inputs(model)
    assert torch.equal(loaded(x, t, y).sample, model(x, t, y).sample)
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert set(sd) == set(sd2) and all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_label_dropout(randomize):
    """In training each label is dropped once per sample, drawn inside the forward as diffusers
    does; ``force_drop_ids`` decides it instead and draws nothing."""
    model = make("MoH-DiT-Tiny", randomize, sample_size=8, class_dropout_prob=0.5)
    x, t, _ = inputs(model, batch=8)
    y = torch.arange(8) % 10
    torch.manual_seed(123)
    trained = model.train()(x, t, y).sample
    torch.manual_seed(123)
    drop = torch.rand(8) < 0.5
    assert 0 < drop.sum() < 8
    expected = model.eval()(x, t, torch.where(drop, torch.full_like(y, 10), y)).sample
    assert torch.allclose(trained, expected, atol=1e-6)
    state = torch.get_rng_state()
    forced = model.train()(x, t, y, force_drop_ids=drop.long()).sample
    assert torch.equal(torch.get_rng_state(), state) and torch.allclose(forced, expected, atol=1e-6)


def test_gradient_checkpointing_same_gradients(randomize):
    model = make("MoH-DiT-Tiny", randomize, sample_size=8).train()
    x, t, y = inputs(model)

    def grads():
        model.zero_grad()
        torch.manual_seed(0)
        out = model(x, t, y)
        (out.sample.square().mean() + 0.01 * out.load_balance_loss).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.enable_gradient_checkpointing()
    ckpt = grads()
    assert set(plain) == set(ckpt) and any("router_routed" in n for n in plain)
    assert all(torch.allclose(plain[n], ckpt[n], atol=1e-6) for n in plain)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.slow
def test_compiles_without_graph_breaks(randomize, train):
    model = make("MoH-DiT-Tiny", randomize, sample_size=8).train(train)
    x, t, y = inputs(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.manual_seed(0)
    out = compiled(x, t, y).sample
    torch.manual_seed(0)
    assert torch.allclose(out, model(x, t, y).sample, atol=1e-6)


def test_bf16_scalar_timestep_and_contiguous_stream(randomize):
    """bf16 follows fp32; a scalar timestep is every image's; each block gets a contiguous
    residual stream (PatchEmbed returns a transposed view, which made every op strided)."""
    model = make("MoH-DiT-Tiny", randomize, sample_size=8)
    x, t, y = inputs(model)
    seen = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    ref = model(x, t, y).sample
    assert seen == [True] * 6
    assert torch.equal(model(x, 10, y).sample, model(x, torch.full((3,), 10), y).sample)
    out = model.to(torch.bfloat16)(x.bfloat16(), t, y).sample
    assert out.dtype == torch.bfloat16 and ((out.float() - ref).norm() / ref.norm()).item() < 0.05


# ------------------------------------------------------------------ diffusers' attention API
def test_attention_forward_returns_hidden_states_and_leaves_its_routing():
    attn, x = _attention(6, 2, 2)
    out = attn(x)
    assert torch.is_tensor(out) and out.shape == x.shape
    assert torch.equal(attn.routing.gates, attn.route(x).gates)
    dense, _ = _attention(4, None, None)
    assert torch.is_tensor(dense(x)) and dense.routing is None


@pytest.mark.parametrize("cfg", ["MoH-DiT-Tiny", "DiT-Tiny"])
def test_fused_qkv_projections_are_opt_in(randomize, cfg):
    """Off by default; ``fuse_qkv_projections`` runs Q, K, V and the routers as one GEMM (the same
    outputs, statistics and input gradients to float rounding; the router rows learn), and
    ``unfuse_qkv_projections`` gives the separate linears back, bit for bit."""
    model = make(cfg, randomize, sample_size=8)
    x, t, y = inputs(model)
    ref = model(x.requires_grad_(True), t, y, output_head_usage=True)
    ref.sample.square().sum().backward()
    ref_grad, x.grad = x.grad.clone(), None
    assert not any(b.attn1.fused_projections for b in model.transformer_blocks)
    model.fuse_qkv_projections()
    attn = model.transformer_blocks[1].attn1
    assert attn.to_qkv.weight.shape == (3 * 128 + sum(r.out_features for r in attn.routers().values()), 128)
    fused = model(x, t, y, output_head_usage=True)
    fused.sample.square().sum().backward()
    assert torch.allclose(fused.sample, ref.sample, atol=1e-5) and torch.allclose(x.grad, ref_grad, atol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(fused.head_usage, ref.head_usage))
    assert not model.is_moh or attn.to_qkv.weight.grad[-4:].abs().sum() > 0
    model.unfuse_qkv_projections()
    assert torch.equal(model(x, t, y).sample, ref.sample) and not hasattr(attn, "to_qkv")
