"""diffusers' extension points on the MoH transformer: attention processors and LoRA adapters.

A processor or an adapter never switches MoH off nor is ignored: any processor still gets the
layer's gates, top-K and statistics (and the routers their gradients), the head-sparse path steps
aside for a LoRA, and LoRA's per-call scale travels in ``cross_attention_kwargs``.
"""

import subprocess
import sys

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

from moh_dit.models import MoHAttnProcessor, MoHDiTTransformer2DModel

pytestmark = pytest.mark.usefixtures("one_thread")

# Every linear of a MoH layer: the attention projections and the routers.
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "router_routed", "router_mix", "router_shared"]


def tiny(randomize, seed=0):
    return randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny/2", sample_size=8), seed=seed).eval()


def inputs(model, batch=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, model.config.in_channels, 8, 8, generator=gen)
    return x, torch.randint(0, 1000, (batch,), generator=gen), torch.randint(0, 12, (batch,), generator=gen)


@torch.no_grad()
def run(model, x, t, y):
    return model(x, t, y, output_load_balance_loss=True, output_head_usage=True)


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


class CountingProcessor:
    """A user's own processor: diffusers' AttnProcessor2_0 (or another) that counts its calls."""

    def __init__(self, inner=None):
        self.inner, self.calls = inner or AttnProcessor2_0(), 0

    def __call__(self, attn, hidden_states, *args, **kwargs):
        self.calls += 1
        return self.inner(attn, hidden_states, *args, **kwargs)


@pytest.mark.parametrize("make", [AttnProcessor2_0, AttnProcessor, CountingProcessor,
                                  lambda: CountingProcessor(MoHAttnProcessor())])
def test_any_processor_keeps_moh(randomize, make):
    """diffusers' stock processors and a user's own compute MoH: the same output, head usage,
    load-balance loss and router gradients as the default processor (MoH's own processor wrapped by
    a user's is not gated twice); ``set_default_attn_processor`` gives MoH's back."""
    model = tiny(randomize)
    x, t, y = inputs(model)

    def results():
        out = run(model, x, t, y)
        model.train().zero_grad(set_to_none=True)
        trained = model(x, t, y, force_drop_ids=torch.zeros_like(y))
        (trained.sample.square().mean() + trained.load_balance_loss).backward()
        model.eval()
        return out, [p.grad.clone() for n, p in model.named_parameters() if ".router_" in n]

    ref, ref_grads = results()
    assert any(u.min() < 1 for u in ref.head_usage)  # some routed heads really are off
    processor = make()
    model.set_attn_processor(processor)
    out, grads = results()
    assert close(out.sample, ref.sample) and close(out.load_balance_loss, ref.load_balance_loss)
    assert all(torch.equal(a, b) for a, b in zip(out.head_usage, ref.head_usage))
    assert all(close(a, b) for a, b in zip(grads, ref_grads))
    assert all(block.attn1.routing is None for block in model.transformer_blocks)
    assert getattr(processor, "calls", 12) == 12  # six layers, two calls
    model.set_default_attn_processor()
    assert all(type(p) is MoHAttnProcessor for p in model.attn_processors.values())


def lora_model(randomize, attach="add_adapter"):
    """The tiny model at its lowest head ratio with a rank-4 LoRA on every linear of every attention
    layer, its B weights non-zero (at initialisation a LoRA changes nothing)."""
    from peft import LoraConfig, inject_adapter_in_model

    model = tiny(randomize)
    model.set_head_activation_ratio(model.head_activation_range[0])
    config = LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS)
    inject_adapter_in_model(config, model) if attach == "peft" else model.add_adapter(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


@pytest.mark.parametrize("attach", ["peft", "add_adapter"])
def test_the_sparse_path_sees_the_lora(randomize, attach):
    """With a LoRA the head-sparse path gives the default path's output (it steps aside: it reads the
    raw weights) and differs from the same path without it."""
    pytest.importorskip("peft")
    base, model = tiny(randomize), lora_model(randomize, attach)
    base.set_head_activation_ratio(base.head_activation_range[0])
    x, t, y = inputs(model)
    ref = run(model, x, t, y).sample
    for sparse in (False, True):
        base.set_sparse_inference(sparse)
        model.set_sparse_inference(sparse)
        assert close(run(model, x, t, y).sample, ref) and not close(run(base, x, t, y).sample, ref)


def test_lora_adapter_api(randomize, tmp_path):
    """add_adapter, disable/enable_adapters, set_adapters, the per-call scale, save_lora_adapter and
    load_lora_adapter into a fresh model."""
    pytest.importorskip("peft")
    x, t, y = inputs(tiny(randomize))
    base = run(tiny(randomize), x, t, y).sample
    model = lora_model(randomize)
    model.set_head_activation_ratio(None)
    lora = run(model, x, t, y).sample
    assert not close(lora, base)
    model.disable_adapters()
    assert torch.equal(run(model, x, t, y).sample, base)
    model.enable_adapters()
    assert torch.equal(run(model, x, t, y).sample, lora)
    half = model(x, t, y, cross_attention_kwargs={"scale": 0.5}).sample  # diffusers' per-call LoRA scale
    model.set_adapters("default", 0.5)
    assert torch.allclose(half, run(model, x, t, y).sample, atol=1e-6) and not close(half, lora)
    model.set_adapters("default", 1.0)
    assert torch.equal(run(model, x, t, y).sample, lora)  # the call's scale is given back
    model.save_lora_adapter(tmp_path)
    fresh = tiny(randomize)
    fresh.load_lora_adapter(tmp_path, prefix=None, use_safetensors=True)
    assert torch.equal(run(fresh, x, t, y).sample, lora)


def test_training_a_lora_leaves_the_base_weights(randomize):
    """A few optimiser steps on the LoRA parameters alone change the output, reach the routers' LoRA
    through the gates, and leave every base weight as it was."""
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
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    model.train()
    for step in range(3):
        out = model(x, t, y, force_drop_ids=torch.zeros_like(y))
        optimizer.zero_grad()
        ((out.sample - step).square().mean() + 0.01 * out.load_balance_loss).backward()
        optimizer.step()
    assert model.transformer_blocks[3].attn1.router_routed.lora_A["default"].weight.grad.abs().sum() > 0
    assert not close(run(model.eval(), x, t, y).sample, before)
    after = model.state_dict()
    for key, value in base_weights.items():
        lora_key = key.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        assert torch.equal(after.get(key, after.get(lora_key)), value), key


@pytest.mark.slow
def test_the_model_and_pipeline_work_without_peft():
    """peft is an optional extra: without it (and without transformers, which diffusers' loaders look
    for) the model and the pipeline import and sample, and the LoRA calls say they need it."""
    code = (
        "import sys; sys.modules['peft'] = None; sys.modules['transformers'] = None\n"
        "import diffusers.utils.import_utils as iu\n"
        "iu._peft_available = iu._transformers_available = False\n"
        "from moh_dit.models import MoHDiTTransformer2DModel\n"
        "from moh_dit.pipelines import MoHDiTPipeline, make_scheduler\n"
        "m = MoHDiTTransformer2DModel.from_preset('MoH-DiT-Tiny', sample_size=8).eval()\n"
        "pipe = MoHDiTPipeline(transformer=m, scheduler=make_scheduler())\n"
        "print(tuple(pipe([1], num_inference_steps=1, output_type='latent').images.shape))\n"
        "for call in (lambda: m.add_adapter(None), lambda: pipe.load_lora_weights({})):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as error:\n"
        "        print(type(error).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["(1,", "3,", "8,", "8)", "ValueError", "ValueError"]
