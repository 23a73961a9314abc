"""MoHDiTTransformer2DModel against an independent reference of the release math.

The reference below is written from docs/design.md (sections 1-3) in plain tensor
operations on a release-format state dict; it shares no code with the package.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moh_dit import PRESETS, MoHDiTTransformer2DModel, head_activation_ratio_of_config, top_k_for_ratio
from moh_dit.hub.convert import model_to_release_state_dict, release_state_dict_to_model
from moh_dit.models.attention import MoHAttention, MoHAttnProcessor
from moh_dit.models.layout import HeadLayout, min_top_k

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
     ("MoH-DiT-S/2-90", 64 / 72), ("MoH-DiT-S/2-75", 54 / 72), ("MoH-DiT-Tiny", 0.75), ("DiT-XL/2", 1.0)],
)
def test_preset_activation_ratio(name, ratio):
    assert head_activation_ratio_of_config(PRESETS[name]) == pytest.approx(ratio, abs=1e-12)
    if "Tiny" in name:
        assert MoHDiTTransformer2DModel.from_preset(name).head_activation_ratio == pytest.approx(ratio)


def test_unknown_preset_lists_known_names():
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
    release = make(UNEVEN, randomize)
    assert (release(x, t, y).sample - ref).abs().max() > 1e-3  # the modes really differ


def test_pos_embed_and_timestep_embedding_follow_dit(randomize):
    model = MoHDiTTransformer2DModel.from_preset("DiT-Tiny")
    table = dit_pos_embed(128, 8)
    assert np.abs(model.pos_embed.pos_embed[0].numpy() - table).max() < 1e-5
    t = torch.tensor([0, 1, 17, 999])
    freqs = torch.exp(-math.log(10000.0) * torch.arange(128, dtype=torch.float64) / 128)
    ang = t[:, None].double() * freqs
    expected = torch.cat([torch.cos(ang), torch.sin(ang)], -1)
    assert (model.time_class_embed.time_proj(t).double() - expected).abs().max() < 1e-4


def test_dit_initialization_zeroes_adaln_and_output():
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8).eval()
    x, t, y = inputs(model)
    assert torch.count_nonzero(model(x, t, y).sample) == 0  # zero output layer
    for block in model.transformer_blocks:
        assert torch.count_nonzero(block.norm1.linear.weight) == 0
    table = model.time_class_embed.class_embedder.embedding_table.weight
    assert table.shape == (11, 128) and 0.015 < table.std().item() < 0.025
    assert model.transformer_blocks[1].attn1.router_routed.weight.abs().sum() > 0


# ------------------------------------------------------------------ gates
def _attention(h, hs, k, mode="release", seed=0):
    torch.manual_seed(seed)
    attn = MoHAttention(16, h, 8, hs, k, mode)
    x = torch.randn(2, 10, 16)
    return attn, x


@pytest.mark.parametrize("h, hs, k", [(6, 2, 2), (6, 0, 3), (5, 1, 2), (4, 4, 0), (4, 3, 1)])
def test_gate_invariants_release(h, hs, k):
    attn, x = _attention(h, hs, k)
    r = attn.route(x)
    g = r.gates
    assert g.shape == (2, 10, h)
    routed = g[..., hs:]
    assert ((routed > 0).sum(-1) == k).all()  # exactly K routed heads per token
    if hs > 0 and k > 0:
        a = torch.softmax(attn.router_mix(x), -1) * 2
        assert torch.allclose(routed.sum(-1), k * a[..., 1], atol=1e-5)  # sum routed = K * a_1
        assert torch.allclose(g[..., :hs].sum(-1), hs * a[..., 0], atol=1e-5)  # sum shared = hs * a_0
    elif k > 0:
        assert torch.allclose(routed.sum(-1), torch.full((2, 10), float(k)), atol=1e-5)
    else:
        assert torch.allclose(g.sum(-1), torch.full((2, 10), float(hs)), atol=1e-5)
    if hs == 1 and k == 0:
        assert torch.equal(g, torch.ones_like(g))
    # the selected routed heads are the top-K of the router probabilities
    if k:
        p = torch.softmax(attn.router_routed(x), -1)
        top = p.topk(k, -1).indices
        mask = torch.zeros_like(p, dtype=torch.bool).scatter(-1, top, True)
        assert torch.equal(mask, routed > 0)
    usage = r.head_usage
    assert torch.equal(usage[:hs], torch.ones(hs)) and usage[hs:].sum().item() == pytest.approx(k)


def test_single_shared_head_has_constant_gate():
    attn, x = _attention(3, 1, 1)
    assert attn.router_shared is None and attn.router_mix is not None
    g = attn.route(x).gates
    a = torch.softmax(attn.router_mix(x), -1) * 2
    assert torch.allclose(g[..., 0], a[..., 0], atol=1e-6)  # 1 * a_0


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
    manual = 2 * (p.mean(0) * torch.tensor([0.75, 0.25])).sum()
    (g_manual,) = torch.autograd.grad(manual, attn.router_routed.weight)
    assert torch.allclose(g_model, g_manual, atol=1e-7)


def test_model_load_balance_loss_is_mean_over_routed_layers(randomize):
    model = make("MoH-DiT-Tiny", randomize, sample_size=8)
    x, t, y = inputs(model)
    per_layer = []
    hooks = [b.attn1.register_forward_hook(lambda m, i, o: per_layer.append(m.routing.load_balance_loss))
             for b in model.transformer_blocks]
    out = model(x, t, y, output_load_balance_loss=True)
    for hk in hooks:
        hk.remove()
    routed = [v for v in per_layer if v is not None]
    assert len(routed) == 5  # layer 0 is all-shared
    assert out.load_balance_loss.item() == pytest.approx(torch.stack(routed).mean().item(), abs=1e-6)
    model.train()
    assert model(x, t, y).load_balance_loss is not None
    model.eval()
    assert model(x, t, y).load_balance_loss is None


def test_head_usage_output(randomize):
    model = make("MoH-DiT-Tiny", randomize, sample_size=8)
    x, t, y = inputs(model)
    usage = model(x, t, y, output_head_usage=True).head_usage
    assert [u.shape[0] for u in usage] == model.layer_heads
    for u, hs, k in zip(usage, model.layer_shared, model.top_k_per_layer):
        assert torch.all(u[:hs] == 1) and u[hs:].sum().item() == pytest.approx(k)
    dense = make("DiT-Tiny", randomize, sample_size=8)
    assert all(torch.all(u == 1) for u in dense(x, t, y, output_head_usage=True).head_usage)


# ------------------------------------------------------------------ head activation ratio
@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("MoH")])
def test_trained_ratio_gives_trained_top_k(name):
    cfg = PRESETS[name]
    L = cfg["num_layers"]
    heads = cfg["num_attention_heads"] if isinstance(cfg["num_attention_heads"], list) else [cfg["num_attention_heads"]] * L
    ratio = head_activation_ratio_of_config(cfg)
    assert top_k_for_ratio(heads, cfg["num_shared_heads"], cfg["top_k"], ratio) == cfg["top_k"]
    total = sum(heads)
    for r in (1.0, 0.95, 0.85, 0.8, 0.7):
        lo = (sum(cfg["num_shared_heads"]) + sum(1 for h, s in zip(heads, cfg["num_shared_heads"]) if s == 0)) / total
        if r < lo:
            continue
        k = top_k_for_ratio(heads, cfg["num_shared_heads"], cfg["top_k"], r)
        realised = (sum(cfg["num_shared_heads"]) + sum(k)) / total
        assert abs(realised - r) <= 0.5 / total + 1e-12  # as close as any layout can get
        assert all(0 <= kk <= h - s for kk, h, s in zip(k, heads, cfg["num_shared_heads"]))


def test_min_top_k_rule():
    """One rule for the smallest routed top-K (a layer without shared heads keeps one routed
    head), and top_k_for_ratio's lowest reachable ratio follows it."""
    assert [min_top_k(h, s) for h, s in [(4, 0), (4, 1), (4, 4), (1, 0)]] == [1, 0, 0, 1]
    heads, shared, trained = [4, 3, 2], [0, 3, 1], [2, 0, 1]
    lowest = (sum(shared) + sum(min_top_k(h, s) for h, s in zip(heads, shared))) / sum(heads)
    assert top_k_for_ratio(heads, shared, trained, lowest) == [1, 0, 0]
    with pytest.raises(ValueError, match="reachable range"):
        top_k_for_ratio(heads, shared, trained, lowest - 0.05)


def test_set_head_activation_ratio(randomize):
    model = make("MoH-DiT-Tiny", randomize, sample_size=8)
    x, t, y = inputs(model)
    base = model(x, t, y).sample
    assert model.set_head_activation_ratio(1.0) == 1.0
    assert model.top_k_per_layer == [0, 2, 2, 3, 2, 4]
    gates = model.transformer_blocks[5].attn1.route(torch.randn(1, 4, 128)).gates
    assert (gates > 0).all()
    assert not torch.allclose(model(x, t, y).sample, base)
    lo, hi = model.head_activation_range
    assert (lo, hi) == (0.5, 1.0)
    assert model.set_head_activation_ratio(0.5) == 0.5 and model.top_k_per_layer == [0, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match=r"reachable range \[0.5000, 1.0\]"):
        model.set_head_activation_ratio(0.4)
    with pytest.raises(ValueError, match="reachable range"):
        model.set_head_activation_ratio(1.2)
    model.set_head_activation_ratio(0.9, overrides={1: 0})
    assert model.top_k_per_layer[1] == 0
    with pytest.raises(ValueError, match="Layer 5"):
        model.set_head_activation_ratio(None, overrides={5: 0})  # no shared head: needs K >= 1
    assert model.set_head_activation_ratio(None) == 0.75 and model.top_k_per_layer == [0, 1, 1, 2, 1, 2]
    assert torch.equal(model(x, t, y).sample, base)
    # the reference agrees at a non-trained top-K too
    model.set_head_activation_ratio(0.9)
    ref, _ = ref_forward(model_to_release_state_dict(model), dict(model.config), x, t, y, top_k=model.top_k_per_layer)
    assert (model(x, t, y).sample - ref).abs().max() <= 1e-5


def test_dense_model_ratio_is_one():
    model = MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8)
    assert model.head_activation_ratio == 1.0 and model.set_head_activation_ratio(None) == 1.0
    with pytest.raises(ValueError, match="dense DiT"):
        model.set_head_activation_ratio(0.5)


# ------------------------------------------------------------------ saving, training features
def test_save_load_roundtrip(tmp_path, randomize):
    model = make("MoH-DiT-Tiny", randomize, sample_size=8, class_names=[f"c{i}" for i in range(10)])
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "diffusion_pytorch_model.safetensors").exists()
    loaded = MoHDiTTransformer2DModel.from_pretrained(tmp_path / "m").eval()
    public = lambda cfg: {k: v for k, v in cfg.items() if not k.startswith("_")}  # noqa: E731
    assert public(loaded.config) == public(model.config)
    assert loaded.config.class_names[3] == "c3" and loaded.trained_top_k == [0, 1, 1, 2, 1, 2]
    x, t, y = inputs(model)
    assert torch.equal(loaded(x, t, y).sample, model(x, t, y).sample)
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert set(sd) == set(sd2) and all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_label_dropout_drawn_once_per_sample(randomize):
    model = make("MoH-DiT-Tiny", randomize, sample_size=8, class_dropout_prob=0.5)
    x, t, y = inputs(model, batch=8)
    y = torch.arange(8) % 10
    model.train()
    torch.manual_seed(123)
    trained = model(x, t, y).sample
    torch.manual_seed(123)
    drop = torch.rand(8) < 0.5
    assert 0 < drop.sum() < 8
    model.eval()
    expected = model(x, t, torch.where(drop, torch.full_like(y, 10), y)).sample
    assert torch.allclose(trained, expected, atol=1e-6)


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


def test_bf16_forward_close_to_fp32(randomize):
    model = make("MoH-DiT-Tiny", randomize, sample_size=8)
    x, t, y = inputs(model)
    ref = model(x, t, y).sample
    out = model.to(torch.bfloat16)(x.bfloat16(), t, y).sample
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.05


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, t, y: (x[:, :2], t, y), "expects in_channels=3"),
        (lambda x, t, y: (x[..., :6, :6], t, y), "not divisible by patch_size=4"),
        (lambda x, t, y: (x[..., :4], t, y), "square"),
        (lambda x, t, y: (x, t, torch.tensor([0, 11, 2])), r"allowed \[0, 10\]"),
        (lambda x, t, y: (x, t, torch.tensor([0, -1, 2])), "out of range"),
        (lambda x, t, y: (x, t, y[:2]), "class_labels must have shape"),
        (lambda x, t, y: (x, t, y.float()), "integer"),
        (lambda x, t, y: (x, t[:2], y), "timestep must be a scalar or have shape"),
        (lambda x, t, y: (x[0], t, y), "batch, channels, height, width"),
    ],
)
def test_bad_input_raises_clear_error(change, message):
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8).eval()
    x, t, y = inputs(model)
    with pytest.raises(ValueError, match=message):
        model(*change(x, t, y))


def test_scalar_timestep_and_null_class_accepted():
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8).eval()
    x, _, _ = inputs(model)
    assert model(x, 10, torch.tensor([10, 10, 10])).sample.shape == (3, 6, 8, 8)


def test_bad_layouts_rejected():
    with pytest.raises(ValueError, match="top_k=0"):
        MoHDiTTransformer2DModel(**{**UNEVEN, "top_k": [0, 0, 1, 3]})
    with pytest.raises(ValueError, match="num_shared_heads=7"):
        MoHDiTTransformer2DModel(**{**UNEVEN, "num_shared_heads": [2, 7, 4, 1]})
    with pytest.raises(ValueError, match="one per layer"):
        MoHDiTTransformer2DModel(**{**UNEVEN, "top_k": [0, 2, 1]})


@pytest.mark.parametrize("field, value, match", [
    ("sample_size", -16, "sample_size must be a positive integer, got -16"),
    ("sample_size", 0, "sample_size must be a positive integer, got 0"),
    ("patch_size", 0, "patch_size must be a positive integer"),
    ("sample_size", 9, "sample_size=9 is not divisible by patch_size=2"),
    ("hidden_size", 50, "hidden_size=50 must be divisible by 4"),
    ("num_layers", 0, "num_layers must be a positive integer"),
    ("num_attention_heads", [2, 0, 6, 5], "num_attention_heads must be a positive integer or a list"),
    ("attention_head_dim", -12, "attention_head_dim must be a positive integer"),
    ("num_classes", 0, "num_classes must be a positive integer"),
    ("in_channels", 2.5, "in_channels must be a positive integer"),
    ("out_channels", 0, "out_channels must be a positive integer"),
    ("mlp_ratio", float("nan"), "mlp_ratio must be a finite number > 0"),
    ("class_dropout_prob", 1.5, r"class_dropout_prob must be a number in \[0, 1\]"),
])
def test_a_config_that_cannot_make_a_model_is_one_line_naming_the_field(field, value, match, tmp_path):
    """Reproduction: sample_size 0 was a ZeroDivisionError inside the position embedding, -16 a
    negative-size error; now the field is named, and the config.json when read from a folder."""
    from moh_dit.models.config_checks import check_transformer_config_file

    with pytest.raises(ValueError, match=match):
        MoHDiTTransformer2DModel(**{**UNEVEN, field: value})
    MoHDiTTransformer2DModel(**UNEVEN).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}: {match}"):
        check_transformer_config_file(tmp_path)


def test_a_model_larger_than_the_memory_is_refused_before_it_is_built(tmp_path, monkeypatch):
    from moh_dit.models.config_checks import check_transformer_config_file, transformer_bytes
    from moh_dit.utils import resources

    model = MoHDiTTransformer2DModel(**UNEVEN)
    params = sum(p.numel() for p in model.parameters()) + model.pos_embed.pos_embed.numel()
    assert transformer_bytes(model.config) == pytest.approx(4 * params, rel=0.05)
    model.save_pretrained(tmp_path)
    check_transformer_config_file(tmp_path)
    monkeypatch.setattr(resources, "available_memory", lambda: 2**16)
    with pytest.raises(ValueError, match=r"config\.json: the transformer \(sample_size 8, hidden_size 48, num_layers 4\) "
                                         r"needs about .* of memory, more than the 64\.0 KiB available"):
        check_transformer_config_file(tmp_path)


def test_residual_stream_is_contiguous(randomize):
    """Every block gets a contiguous (B, T, D) residual stream. PatchEmbed returns a
    transposed view; carried through the blocks it made every elementwise op strided
    (a DiT-XL/2 forward took 30 % longer on an H200)."""
    model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny")).eval()
    seen = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32), torch.tensor([1, 500]), torch.tensor([0, 3]))
    assert seen == [True] * len(model.transformer_blocks)


def test_label_embedding_init_std_is_an_initialisation_option():
    """DiT's N(0, 0.02) label table by default; the CPU demo's preset starts it at unit scale."""
    torch.manual_seed(0)
    default = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", num_classes=1000)
    table = default.time_class_embed.class_embedder.embedding_table.weight
    assert float(table.std()) == pytest.approx(0.02, rel=0.05)
    demo = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny/2", num_classes=1000)
    assert float(demo.time_class_embed.class_embedder.embedding_table.weight.std()) == pytest.approx(1.0, rel=0.05)
    assert demo.config.label_embedding_init_std == 1.0 and demo.config.patch_size == 2
    with pytest.raises(ValueError, match="label_embedding_init_std"):
        MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", label_embedding_init_std=-1.0)


# ------------------------------------------------------------------ attention like diffusers' Attention
def test_attention_forward_returns_hidden_states_and_leaves_its_routing():
    """``MoHAttention(x)`` returns the (B, N, D) output only, like diffusers' ``Attention``; the
    call's routing waits on ``attn.routing``, and the block reads and clears it."""
    attn, x = _attention(6, 2, 2)
    out = attn(x)
    assert torch.is_tensor(out) and out.shape == x.shape
    assert torch.equal(attn.routing.gates, attn.route(x).gates)
    assert attn.routing.load_balance_loss is not None and attn.routing.head_usage.shape == (6,)
    dense, _ = _attention(4, None, None)
    assert torch.is_tensor(dense(x)) and dense.routing is None


def test_blocks_read_and_clear_the_routing(randomize):
    """The model's statistics come from each layer's routing, which no layer keeps after the
    forward pass (no tensors held between steps), with and without gradient checkpointing."""
    model = make("MoH-DiT-Tiny", randomize, sample_size=8).train()
    x, t, y = inputs(model)
    for checkpointing in (False, True):
        if checkpointing:
            model.enable_gradient_checkpointing()
        out = model(x, t, y, output_head_usage=True)
        out.load_balance_loss.backward()
        assert out.load_balance_loss.item() > 0 and len(out.head_usage) == 6
        assert model.transformer_blocks[1].attn1.router_routed.weight.grad.abs().sum() > 0
        assert all(block.attn1.routing is None for block in model.transformer_blocks)
        model.zero_grad()


def test_attn_processors_and_set_attn_processor(randomize):
    """diffusers' processor API: ``attn_processors`` lists every layer's processor, and
    ``set_attn_processor`` sets one for all layers or a dict of them."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    model = make("DiT-Tiny", randomize, sample_size=8)
    processors = model.attn_processors
    assert list(processors) == [f"transformer_blocks.{i}.attn1.processor" for i in range(6)]
    assert all(type(p) is MoHAttnProcessor for p in processors.values())
    x, t, y = inputs(model)
    ours = model(x, t, y).sample
    model.set_attn_processor(AttnProcessor2_0())
    assert all(type(p) is AttnProcessor2_0 for p in model.attn_processors.values())
    assert torch.allclose(model(x, t, y).sample, ours, atol=1e-6)
    model.set_attn_processor(processors)  # back, by name
    assert torch.equal(model(x, t, y).sample, ours)


@pytest.mark.parametrize("bias", [True, False])
def test_stock_diffusers_processor_equals_ours_on_a_dense_layer(bias):
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    torch.manual_seed(0)
    attn = MoHAttention(16, 4, 8, bias=bias).eval()
    x = torch.randn(2, 10, 16)
    ours = attn(x)
    attn.set_processor(AttnProcessor2_0())  # the same SDPA call: the same bits
    assert torch.equal(attn(x), ours) and attn.routing is None
    attn.set_processor(AttnProcessor())  # explicit softmax(QK^T)V
    assert torch.allclose(attn(x), ours, atol=1e-6)


def test_head_layout_is_parsed_once():
    """One type for the layer layout: what the model, the presets and the FLOP count read."""
    layout = HeadLayout.of_config(PRESETS["MoH-DiT-Tiny"])
    assert layout == HeadLayout((4,) * 6, (4, 2, 2, 1, 2, 0), (0, 1, 1, 2, 1, 2)) and layout.is_moh
    assert layout.activation_ratio() == 0.75 and layout.reachable_range() == (0.5, 1.0)
    assert layout.top_k_for_ratio(1.0) == [0, 2, 2, 3, 2, 4]
    assert HeadLayout.of_config(PRESETS["DiT-Tiny"]) == HeadLayout((4,) * 6, None, None)
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8)
    assert model.layout == layout and model.trained_top_k == [0, 1, 1, 2, 1, 2]
    with pytest.raises(ValueError, match="Layer 1: top_k=3"):
        HeadLayout.parse(2, 4, [4, 2], [0, 3])


def test_weights_that_do_not_fit_the_config_name_the_folder(tmp_path):
    """An edited config.json (out_channels 7) whose weights no longer fit is refused naming the
    folder and the parameter, where diffusers names neither."""
    from moh_dit.errors import DamagedFile

    folder = tmp_path / "model"
    MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["out_channels"] = 7
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DamagedFile) as error:
        MoHDiTTransformer2DModel.from_pretrained(folder)
    assert str(folder) in str(error.value) and "proj_out_2" in str(error.value)
