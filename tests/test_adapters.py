"""diffusers' extension points on the MoH transformer: attention processors and LoRA adapters.

A processor or an adapter never switches MoH off nor is ignored: any processor still gets the
layer's gates, top-K and statistics, and the head-sparse path gives the default path's result
with a LoRA in place (it steps aside). LoRA's per-call scale travels in cross_attention_kwargs.
"""

import subprocess
import sys

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

from moh_dit.models import MoHAttnProcessor, MoHDiTTransformer2DModel, MoHRouting

pytestmark = pytest.mark.usefixtures("one_thread")

# Every linear of a MoH layer: the attention projections and the routers.
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "router_routed", "router_mix", "router_shared"]


def tiny(randomize, seed=0):
    return randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny/2", sample_size=8), seed=seed).eval()


def inputs(model, batch=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, model.config.in_channels, 8, 8, generator=gen)
    t = torch.randint(0, 1000, (batch,), generator=gen)
    y = torch.randint(0, model.config.num_classes, (batch,), generator=gen)
    return x, t, y


@torch.no_grad()
def run(model, x, t, y):
    return model(x, t, y, output_load_balance_loss=True, output_head_usage=True)


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ attention processors
class CountingProcessor:
    """A user's own processor: diffusers' AttnProcessor2_0 that counts its calls."""

    def __init__(self, inner=None):
        self.inner, self.calls = inner or AttnProcessor2_0(), 0

    def __call__(self, attn, hidden_states, *args, **kwargs):
        self.calls += 1
        return self.inner(attn, hidden_states, *args, **kwargs)


PROCESSORS = {
    "AttnProcessor2_0": AttnProcessor2_0,
    "AttnProcessor": AttnProcessor,
    "counting": CountingProcessor,
    "counting around MoH's own": lambda: CountingProcessor(MoHAttnProcessor()),
}


@pytest.mark.parametrize("name", PROCESSORS)
def test_any_processor_keeps_moh(randomize, name):
    """diffusers' stock processors and a user's own compute MoH: the same output, head usage
    and load-balance loss as the default processor (unselected heads stay off; MoH's own
    processor wrapped by a user's is not gated twice)."""
    model = tiny(randomize)
    x, t, y = inputs(model)
    ref = run(model, x, t, y)
    assert any(u.min() < 1 for u in ref.head_usage)  # some routed heads really are off
    model.set_attn_processor(PROCESSORS[name]())
    out = run(model, x, t, y)
    assert close(out.sample, ref.sample)
    assert close(out.load_balance_loss, ref.load_balance_loss)
    assert all(torch.equal(a, b) for a, b in zip(out.head_usage, ref.head_usage))
    assert all(block.attn1.routing is None for block in model.transformer_blocks)


def test_routers_learn_through_any_processor(randomize):
    """In training the gates applied for a stock processor carry the routers' gradients."""
    model = tiny(randomize).train()
    x, t, y = inputs(model)
    keep = torch.zeros_like(y)

    def router_grads():
        model.zero_grad(set_to_none=True)
        out = model(x, t, y, force_drop_ids=keep)
        (out.sample.square().mean() + out.load_balance_loss).backward()
        return [p.grad.clone() for n, p in model.named_parameters() if ".router_" in n]

    ref = router_grads()
    model.set_attn_processor(AttnProcessor2_0())
    assert all(close(a, b) for a, b in zip(router_grads(), ref))


def test_a_users_processor_is_kept_by_the_switches(randomize):
    """Turning the head-sparse path off, or the default processor back on, replaces a user's
    processor only when asked: set_sparse_inference(False) puts MoH's dense-masked one back."""
    model = tiny(randomize)
    x, t, y = inputs(model)
    ref = run(model, x, t, y).sample
    processor = CountingProcessor()
    model.set_attn_processor(processor)
    assert close(run(model, x, t, y).sample, ref) and processor.calls == len(model.transformer_blocks)
    model.set_sparse_inference(False)
    assert all(type(p) is MoHAttnProcessor for p in model.attn_processors.values())


# ------------------------------------------------------------------ the load-balance loss
def test_load_balance_loss_is_k_at_perfect_balance():
    """``E * sum_i P_i f_i`` with uniform router probabilities and every routed head in the
    top-K of the same share of tokens is K (here 2 of E = 4)."""
    probs = torch.full((1, 4, 4), 0.25)  # (B, N, E)
    routed_index = torch.tensor([[[0, 1], [2, 3], [1, 2], [3, 0]]])  # (B, N, K): each head twice
    routing = MoHRouting(torch.ones(1, 4, 4), routed_index, torch.ones(1, 4, 2), probs)
    assert routing.routed_usage.tolist() == [0.5] * 4
    assert routing.load_balance_loss.item() == pytest.approx(2.0)


# ------------------------------------------------------------------ LoRA on every path
def lora_model(randomize, attach):
    """The tiny model at its lowest head ratio with a rank-4 LoRA on every linear of every
    attention layer, its B weights non-zero (at initialisation a LoRA changes nothing)."""
    from peft import LoraConfig, inject_adapter_in_model

    model = tiny(randomize)
    model.set_head_activation_ratio(model.head_activation_range[0])
    config = LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS)
    if attach == "peft":
        inject_adapter_in_model(config, model)
    else:
        model.add_adapter(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


@pytest.mark.parametrize("attach", ["peft", "add_adapter"])
def test_every_path_sees_the_lora(randomize, attach):
    """With the LoRA the head-sparse path gives the default path's output (it steps aside: it would
    read the raw weights) and differs from the same path without it. Fusing copies the weights, as
    diffusers' fuse does: fuse a LoRA first (``fuse_lora``)."""
    pytest.importorskip("peft")
    base = tiny(randomize)
    base.set_head_activation_ratio(base.head_activation_range[0])
    model = lora_model(randomize, attach)
    x, t, y = inputs(model)
    ref = run(model, x, t, y).sample
    for path in ("default", "sparse"):
        base.set_sparse_inference(path == "sparse")
        model.set_sparse_inference(path == "sparse")
        assert close(run(model, x, t, y).sample, ref), path
        assert not close(run(base, x, t, y).sample, ref), path


# ------------------------------------------------------------------ diffusers' LoRA API
def test_lora_adapter_api(randomize, tmp_path):
    """add_adapter, set_adapters, disable/enable_adapters, save_lora_adapter and
    load_lora_adapter into a fresh model."""
    pytest.importorskip("peft")
    x, t, y = inputs(tiny(randomize))
    base = run(tiny(randomize), x, t, y).sample
    model = lora_model(randomize, "add_adapter")
    model.set_head_activation_ratio(None)
    lora = run(model, x, t, y).sample
    assert not close(lora, base)
    model.disable_adapters()
    assert torch.equal(run(model, x, t, y).sample, base)
    model.enable_adapters()
    assert torch.equal(run(model, x, t, y).sample, lora)
    model.set_adapters("default", 0.0)
    assert close(run(model, x, t, y).sample, base)
    model.set_adapters("default", 1.0)
    half = model(x, t, y, cross_attention_kwargs={"scale": 0.5}).sample  # diffusers' per-call LoRA scale
    model.set_adapters("default", 0.5)
    assert torch.allclose(half, run(model, x, t, y).sample, atol=1e-6) and not close(half, lora)
    model.set_adapters("default", 1.0)
    assert torch.equal(run(model, x, t, y).sample, lora)  # the call's scale is given back
    model.save_lora_adapter(tmp_path)
    fresh = tiny(randomize)
    fresh.load_lora_adapter(tmp_path, prefix=None, use_safetensors=True)  # diffusers' model-level call
    assert torch.equal(run(fresh, x, t, y).sample, lora)


def test_training_a_lora_leaves_the_base_weights(randomize):
    """A few optimiser steps on the LoRA parameters alone change the output, reach the
    routers' LoRA through the gates, and leave every base weight as it was."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    model = tiny(randomize)
    base_weights = {k: v.clone() for k, v in model.state_dict().items()}
    x, t, y = inputs(model)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS))
    before = run(model, x, t, y).sample
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    assert params and all(p.requires_grad for p in params)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    model.train()
    for step in range(3):
        out = model(x, t, y, force_drop_ids=torch.zeros_like(y))
        loss = (out.sample - step).square().mean() + 0.01 * out.load_balance_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    router_lora = model.transformer_blocks[3].attn1.router_routed.lora_A["default"].weight
    assert router_lora.grad.abs().sum() > 0
    assert not close(run(model.eval(), x, t, y).sample, before)
    after = model.state_dict()
    for key, value in base_weights.items():
        lora_key = key.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        assert torch.equal(after.get(key, after.get(lora_key)), value), key


@pytest.mark.slow
def test_the_model_works_without_peft():
    """peft is an optional extra: without it (and without transformers, which peft brings and
    diffusers' loaders look for) the model and the pipeline import, the model builds and runs,
    and the LoRA API says to install peft."""
    code = (
        "import sys; sys.modules['peft'] = None; sys.modules['transformers'] = None\n"
        "import diffusers.utils.import_utils as iu\n"
        "iu._peft_available = iu._transformers_available = False\n"
        "import torch\n"
        "from moh_dit import MoHDiTPipeline, MoHDiTTransformer2DModel\n"
        "m = MoHDiTTransformer2DModel.from_preset('MoH-DiT-Tiny/2', sample_size=8).eval()\n"
        "print(tuple(m(torch.randn(1, 3, 8, 8), 10, torch.tensor([1])).sample.shape))\n"
        "try:\n"
        "    m.add_adapter(None)\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    shape, error = result.stdout.strip().splitlines()
    assert shape == "(1, 6, 8, 8)" and "install" in error and "peft" in error
