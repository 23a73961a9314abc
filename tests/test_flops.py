"""moh_dit.models.flops: the attention formula by hand, the whole forward pass against torch's own
FLOP counter, DiT-XL/2 against the DiT paper, and ratios."""

from fractions import Fraction

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from moh_dit.models import PRESETS, HeadLayout, MoHDiTTransformer2DModel, attention_flops, forward_flops, model_attention_flops

import reference_attention as reference  # test-only helpers (tests/ is on pytest's pythonpath)


def meta_model(name: str, **overrides) -> MoHDiTTransformer2DModel:
    """The model of a preset without memory for its weights (only its layout matters here)."""
    with torch.device("meta"):
        return MoHDiTTransformer2DModel.from_preset(name, **overrides)


def counted_forward(model: MoHDiTTransformer2DModel, batch: int = 1) -> dict[str, int]:
    """torch's FlopCounterMode over one forward pass, by aten op. SDPA runs its math backend: the
    counter has no formula for the CPU flash kernel, while the math backend's two bmm are counted."""
    cfg = model.config
    x = torch.randn(batch, cfg.in_channels, cfg.sample_size, cfg.sample_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(x, torch.full((batch,), 10), torch.zeros(batch, dtype=torch.long))
    finally:
        torch.set_num_threads(threads)
    return {str(op).split(".")[-1]: flops for op, flops in counter.get_flop_counts()["Global"].items()}


def test_attention_flops_by_hand():
    # N=4 tokens, D=8, D_in=8: dense 2*4*8*8*4 + 4*16*8 = 2048 + 512.
    assert attention_flops(4, 8, 8) == 2560 and isinstance(attention_flops(4, 8, 8), int)
    # Half the (token, head) pairs: 2*4*8*8*(2 + 1) + 4*0.5*16*8 = 1536 + 256, exact as a Fraction.
    assert attention_flops(4, 8, 8, Fraction(1, 2)) == 1792 and isinstance(attention_flops(4, 8, 8, Fraction(1, 2)), int)
    assert attention_flops(4, 8, 8, 0.5) == 1792.0 and isinstance(attention_flops(4, 8, 8, 0.5), float)
    assert attention_flops(4, 8, 8, 0) == 1024  # K and V projections only
    assert attention_flops(4, 8, 8, Fraction(1, 3)) == pytest.approx(2 * 4 * 8 * 8 * (2 + 2 / 3) + 4 / 3 * 16 * 8)


def test_ideal_flop_ratio_keeps_its_numbers():
    """The formula ideal_flop_ratio had inline, to the last bit, for float ratios."""
    for tokens, hidden, inner in ((16, 128, 128), (256, 768, 768), (1024, 1152, 1152), (256, 1152, 1728)):
        for ratio in (0.0, 0.1, 1 / 3, 0.5, 0.75, 403 / 448, 1.0):
            dense = 2 * tokens * hidden * inner * 4 + 4 * tokens**2 * inner
            sparse = 2 * tokens * hidden * inner * (2 + 2 * ratio) + 4 * ratio * tokens**2 * inner
            assert reference.ideal_flop_ratio(tokens, hidden, inner, ratio) == sparse / dense


def test_per_layer_attention_counts_at_every_preset():
    """The per-layer integer count, written out, at every preset's trained layout, from the model
    and from its config alike."""
    for name, cfg in PRESETS.items():
        n, d, D = (cfg["sample_size"] // cfg["patch_size"]) ** 2, cfg["attention_head_dim"], cfg["hidden_size"]
        layout = HeadLayout.of_config(cfg)
        heads = layout.heads
        active = [s + k for s, k in zip(layout.shared, layout.top_k)] if layout.is_moh else heads
        sparse = sum(2 * n * D * d * (2 * h + 2 * a) + 4 * n * n * a * d for h, a in zip(heads, active))
        dense = sum(2 * n * D * h * d * 4 + 4 * n * n * h * d for h in heads)
        assert model_attention_flops(cfg) == (sparse, dense), name
        if name in ("MoH-DiT-XL/2-75", "DiT-B/4"):
            assert model_attention_flops(meta_model(name)) == (sparse, dense), name


def test_forward_matches_torch_flop_counter():
    """Every matmul a forward runs, counted by torch, op by op exact: a DiT (the patch embedding is
    the convolution, the core 4 N^2 D_in per layer the math SDPA's bmm); a MoH-DiT on the
    dense-masked path computes every head, so torch counts the attention at ratio 1.0 plus the
    routers (the bias-free ``mm``; inside the fused GEMM, an addmm)."""
    model = MoHDiTTransformer2DModel.from_preset("DiT-Tiny").eval()  # 64 tokens, 6 layers, D_in 128
    counted = counted_forward(model, batch=2)
    assert counted["bmm"] == 2 * 6 * 4 * 64**2 * 128
    assert sum(counted.values()) == forward_flops(model, batch=2) == 2 * forward_flops(model)
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny").eval()
    counted = counted_forward(model)
    assert sum(counted.values()) == forward_flops(model, ratio=1.0) and counted["mm"] > 0
    model.fuse_qkv_projections()
    counted = counted_forward(model)
    assert sum(counted.values()) == forward_flops(model, ratio=1.0) and "mm" not in counted


def test_dit_xl_2_against_the_dit_paper():
    """DiT-XL/2 at 256 px: 237,242,843,136 FLOPs, i.e. 118.62 G multiply-adds; the DiT paper
    (Table 4) gives 118.6 GFLOPs, counted as multiply-adds."""
    flops = forward_flops(PRESETS["DiT-XL/2"])
    assert flops == 237_242_843_136 and flops / 2e9 == pytest.approx(118.6, abs=0.05)
    assert forward_flops(meta_model("DiT-XL/2")) == flops  # a model and its config count the same


def test_ratio_changes_only_the_attention_and_leaves_the_model_alone():
    model = meta_model("MoH-DiT-XL/2-75")  # reachable: [0.6652, 1]
    model.set_head_activation_ratio(0.8)  # a non-trained setting, the default of ratio=None
    before = model.top_k_per_layer
    flops = {ratio: forward_flops(model, ratio) for ratio in (None, 1.0, 0.75, 0.7)}
    attention = {ratio: model_attention_flops(model, ratio=ratio)[0] for ratio in flops}
    assert model.top_k_per_layer == before
    assert attention[1.0] == model_attention_flops(model)[1] and attention[None] == model_attention_flops(model)[0]
    assert len(set(attention.values())) == 4 and attention[1.0] > attention[None] > attention[0.75] > attention[0.7]
    assert len({flops[r] - attention[r] for r in flops}) == 1  # nothing else changes
    config = PRESETS["MoH-DiT-XL/2-75"]
    assert forward_flops(config) == forward_flops(meta_model("MoH-DiT-XL/2-75"))  # trained layout
    for ratio in (1.0, 0.8, 0.7, 0.9):  # a config dict at any ratio: the model's top-K rule
        assert forward_flops(config, ratio) == forward_flops(model, ratio), ratio
    assert forward_flops(PRESETS["DiT-B/2"], 1.0) == forward_flops(PRESETS["DiT-B/2"])
