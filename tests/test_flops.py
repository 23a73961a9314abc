"""moh_dit.models.flops: the attention formula by hand, the whole forward pass against torch's own
FLOP counter, DiT-XL/2 against the DiT paper, ratios, and the callers that must keep their
numbers (the tests' ideal_flop_ratio, the sweep's FLOP columns)."""

import importlib.util
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from moh_dit import MoHDiTTransformer2DModel, PRESETS, get_preset
from moh_dit.models.flops import attention_flops, forward_flop_terms, forward_flops, model_attention_flops
from moh_dit.sampling.sweep import attention_flops as sweep_attention_flops

import reference_attention as reference  # test-only helpers (tests/ is on pytest's pythonpath)
ideal_flop_ratio = reference.ideal_flop_ratio


def meta_model(name: str, **overrides) -> MoHDiTTransformer2DModel:
    """The model of a preset without memory for its weights (only its layout matters here)."""
    with torch.device("meta"):
        return MoHDiTTransformer2DModel.from_preset(name, **overrides)


def counted_forward(model: MoHDiTTransformer2DModel, batch: int = 1) -> dict[str, int]:
    """torch's FlopCounterMode over one forward pass, by aten op. SDPA runs its math backend:
    the counter has no formula for the CPU flash kernel (it would count the attention core as 0),
    while the math backend's two bmm are counted."""
    cfg = model.config
    x = torch.randn(batch, cfg.in_channels, cfg.sample_size, cfg.sample_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared machine a second intra-op thread only waits
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
    for bad in (-0.1, 1.5, Fraction(4, 3)):
        with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
            attention_flops(4, 8, 8, bad)


def test_ideal_flop_ratio_keeps_its_numbers():
    """The formula ideal_flop_ratio had inline, to the last bit, for float ratios."""
    for tokens, hidden, inner in ((16, 128, 128), (256, 768, 768), (1024, 1152, 1152), (256, 1152, 1728)):
        for ratio in (0.0, 0.1, 1 / 3, 0.5, 0.75, 403 / 448, 1.0):
            dense = 2 * tokens * hidden * inner * 4 + 4 * tokens**2 * inner
            sparse = 2 * tokens * hidden * inner * (2 + 2 * ratio) + 4 * ratio * tokens**2 * inner
            assert ideal_flop_ratio(tokens, hidden, inner, ratio) == sparse / dense


@pytest.mark.slow
def test_sweep_columns_keep_their_numbers():
    """The sweep's per-layer integer count (before moh_dit.models.flops) at every preset's trained layout."""
    for name in PRESETS:
        model = meta_model(name)
        cfg = model.config
        n, d, D = (cfg.sample_size // cfg.patch_size) ** 2, cfg.attention_head_dim, cfg.hidden_size
        shared = model.layer_shared or model.layer_heads
        top_k = model.top_k_per_layer if model.is_moh else [0] * len(model.layer_heads)
        sparse = sum(2 * n * D * d * (2 * h + 2 * (s + k)) + 4 * n * n * (s + k) * d
                     for h, s, k in zip(model.layer_heads, shared, top_k))
        dense = sum(2 * n * D * h * d * 4 + 4 * n * n * h * d for h in model.layer_heads)
        assert sweep_attention_flops(model) == model_attention_flops(model) == (sparse, dense), name
        assert model_attention_flops(get_preset(name)) == (sparse, dense), name


def test_dense_dit_forward_matches_torch_flop_counter():
    """A DiT-S/2 forward (256 tokens) counted by torch: every matmul the model runs. The two
    counts agree exactly (tolerance 0), op by op: the patch embedding is the convolution, the
    attention core (4 N^2 D_in per layer) the math SDPA's bmm, the rest linear layers."""
    model = MoHDiTTransformer2DModel.from_preset("DiT-S/2").eval()
    counted = counted_forward(model, batch=2)
    terms = forward_flop_terms(model, batch=2)
    tokens, inner, layers = 256, 384, 12
    assert counted["convolution"] == terms["patch_embedding"]
    assert counted["bmm"] == 2 * layers * 4 * tokens**2 * inner
    assert sum(counted.values()) == forward_flops(model, batch=2) == 2 * forward_flops(model)
    assert terms["routers"] == 0


def test_moh_forward_matches_torch_flop_counter():
    """MoH-DiT-S/2-75 on the dense-masked path computes every head, so torch counts the dense
    attention (forward_flops at ratio 1.0) plus every router, which are the plain ``mm``."""
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-S/2-75").eval()
    model.set_sparse_inference(False)
    for block in model.transformer_blocks:
        block.attn1.fused_projections = True  # forced: the default fuses on CUDA only
    counted = counted_forward(model)  # the routers run inside the fused QKV GEMM (an addmm)
    assert sum(counted.values()) == forward_flops(model, ratio=1.0) and "mm" not in counted
    for block in model.transformer_blocks:
        block.attn1.fused_projections = False
    counted = counted_forward(model)  # separate linears: the bias-free routers are the plain mm
    assert sum(counted.values()) == forward_flops(model, ratio=1.0)
    assert counted["mm"] == forward_flop_terms(model)["routers"] > 0


def test_dit_xl_2_against_the_dit_paper():
    """DiT-XL/2 at 256 px: 237,242,843,136 FLOPs, i.e. 118.62 G multiply-adds; the DiT paper
    (Table 4) gives 118.6 GFLOPs, counted as multiply-adds."""
    flops = forward_flops(get_preset("DiT-XL/2"))
    assert flops == 237_242_843_136
    assert flops / 2e9 == pytest.approx(118.6, abs=0.05)
    terms = forward_flop_terms(get_preset("DiT-XL/2"))
    assert terms["attention"] + terms["mlp"] == 28 * (24 * 256 * 1152**2 + 4 * 256**2 * 1152)
    assert forward_flops(meta_model("DiT-XL/2")) == flops  # a model and its config count the same


def test_ratio_changes_only_the_attention_and_leaves_the_model_alone():
    model = meta_model("MoH-DiT-XL/2-75")  # reachable: [0.6652, 1]
    model.set_head_activation_ratio(0.8)  # a non-trained setting, the default of ratio=None
    before = model.top_k_per_layer
    terms = {ratio: forward_flop_terms(model, ratio) for ratio in (None, 1.0, 0.75, 0.7)}
    assert model.top_k_per_layer == before
    assert terms[None]["attention"] == model_attention_flops(model)[0]
    assert terms[1.0]["attention"] == model_attention_flops(model)[1]
    attention = [terms[r]["attention"] for r in (1.0, None, 0.75, 0.7)]
    assert attention == sorted(attention, reverse=True) and len(set(attention)) == 4
    for part in ("patch_embedding", "timestep_embedding", "adaln_modulation", "routers", "mlp", "final_layer"):
        assert len({t[part] for t in terms.values()}) == 1, part
    config = get_preset("MoH-DiT-XL/2-75")
    assert forward_flops(config) == forward_flops(meta_model("MoH-DiT-XL/2-75"))  # trained layout
    assert forward_flops(config, 1.0) == forward_flops(model, 1.0)
    # a config dict at any ratio: the model's top-K rule without building the model
    for ratio in (0.8, 0.7, 0.9):
        assert forward_flop_terms(config, ratio) == forward_flop_terms(model, ratio), ratio
    assert forward_flops(get_preset("MoH-DiT-S/2-90", sample_size=16), 0.75) == forward_flops(
        meta_model("MoH-DiT-S/2-90", sample_size=16), 0.75)
    for source in (model, config):
        with pytest.raises(ValueError, match="reachable range"):
            forward_flops(source, 0.5)
    with pytest.raises(ValueError, match="dense DiT always runs at head activation ratio 1.0"):
        forward_flops(get_preset("DiT-B/2"), 0.5)
    assert forward_flops(get_preset("DiT-B/2"), 1.0) == forward_flops(get_preset("DiT-B/2"))


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        forward_flops(get_preset("DiT-S/2"), batch=0)
    with pytest.raises(ValueError, match="lacks"):
        forward_flops({"hidden_size": 384})
    with pytest.raises(ValueError, match="top_k has 2 entries for a 12-layer model"):
        model_attention_flops(get_preset("MoH-DiT-S/2-75"), [1, 1])


def test_peak_flops_table_by_device_name_and_measured_fallback(monkeypatch):
    from moh_dit.utils import speed

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    peak, source = speed.peak_flops("cuda", torch.bfloat16)
    assert peak == pytest.approx(989.4e12) and source.startswith("datasheet peak of NVIDIA H200, bf16/fp16")
    assert speed.peak_flops("cuda", torch.float32, allow_tf32=True)[0] == pytest.approx(494.7e12)
    assert speed.peak_flops("cuda", torch.float32, allow_tf32=False)[0] == pytest.approx(66.9e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert speed.peak_flops("cuda", torch.float16)[0] == pytest.approx(756.0e12)  # not the SXM figure
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert speed.peak_flops("cuda", torch.bfloat16)[0] == pytest.approx(312.0e12)
    peak, source = speed.peak_flops("cpu")  # no table for CPUs: a timed matmul
    assert peak > 1e8 and source.startswith("measured matmul on cpu (float32)")


def test_training_flops_are_three_forwards_on_the_dense_masked_path():
    from moh_dit.utils import speed

    assert speed.training_flops_per_image(get_preset("DiT-XL/2")) == 3 * 237_242_843_136
    moh = get_preset("MoH-DiT-XL/2-90")
    # training computes every head (dense-masked), so the count is at ratio 1.0, routers included
    assert speed.training_flops_per_image(moh) == 3 * forward_flops(moh, ratio=1.0) > 3 * forward_flops(moh)


def test_measuring_the_matmul_peak_leaves_the_global_random_stream_alone():
    """Training measures the peak at the start of a run; drawing from the global generator
    there would change every fresh run's noise, timesteps and so its weights."""
    from moh_dit.utils.speed import measure_matmul_flops

    torch.manual_seed(123)
    before = torch.get_rng_state()
    assert measure_matmul_flops("cpu", size=64, repeats=1) > 0
    assert torch.equal(torch.get_rng_state(), before)
