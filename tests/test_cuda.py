"""CUDA checks: the head-sparse computation, the fused projections and the model on a GPU.

Skipped without a CUDA device (CI has none); run them on a GPU machine with
``python -m pytest -q tests/test_cuda.py``. Sizes use head dims the fused attention kernels
accept (multiples of 8), so the flash / memory-efficient kernels are the ones tested.
"""

import pytest
import torch

from moh_dit.models import MoHAttention, MoHAttnProcessor, MoHDiTTransformer2DModel, MoHSparseAttnProcessor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DENSE, SPARSE = MoHAttnProcessor(), MoHSparseAttnProcessor()


@pytest.fixture(autouse=True)
def exact_fp32():
    """No TF32 anywhere (the patch embedding is a convolution: cuDNN allows TF32 by default)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def layer(heads, shared, k, head_dim=72, seed=0):
    torch.manual_seed(seed)
    attn = MoHAttention(heads * head_dim, heads, head_dim, shared, k).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return attn.cuda()


@pytest.mark.parametrize("heads, shared, k", [(16, 0, 8), (16, 0, 1), (16, 4, 3), (12, 2, 9), (8, 1, 5)])
def test_sparse_equals_dense_masked(heads, shared, k):
    """fp32 to rounding at 1, 256 and 1024 tokens; in bf16 within bf16 rounding of fp32."""
    attn = layer(heads, shared, k)
    for batch, tokens in [(1, 1), (3, 256), (2, 1024)]:
        x = torch.randn(batch, tokens, heads * 72, device="cuda")
        with torch.no_grad():
            routing = attn.route(x)
            assert rel_err(SPARSE(attn, x, routing), DENSE(attn, x, routing)) <= 1e-5, (batch, tokens)
    with torch.no_grad():
        exact = DENSE(attn, x, routing)
        attn.to(torch.bfloat16)
        masked, sparse = DENSE(attn, x.bfloat16(), routing), SPARSE(attn, x.bfloat16(), routing)
    assert sparse.dtype == torch.bfloat16 and rel_err(sparse, exact) <= 2 * rel_err(masked, exact) + 1e-3


def test_dense_masked_model_runs_without_host_sync(randomize):
    """A sampling-mode forward on the dense-masked path (the default), fused or not, never waits
    for the GPU: torch raises on a synchronising call under sync debug mode "error" (it sees most,
    not all)."""
    model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-S/2-75", sample_size=16)).cuda().eval()
    model.set_sparse_inference(False)
    latents = torch.randn(2, 4, 16, 16, device="cuda")
    t = torch.tensor([10, 500], device="cuda")
    y = torch.tensor([3, 1000], device="cuda")
    for fuse in (False, True):
        if fuse:
            model.fuse_qkv_projections()
        with torch.no_grad():
            model(latents, t, y)  # warm-up: lazy initialisation may synchronise
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                model(latents, t, y)
            finally:
                torch.cuda.set_sync_debug_mode("default")


def test_model_on_cuda_matches_cpu(randomize):
    """A MoH-DiT-S/2-75 forward on the GPU (dense-masked and head-sparse at a lowered ratio)
    equals the CPU float32 result."""
    model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-S/2-75", sample_size=16), std=0.05).eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 16, 16, generator=gen)
    t = torch.tensor([0, 250, 999])
    y = torch.tensor([1, 7, 1000])
    model.set_head_activation_ratio(0.6)
    with torch.no_grad():
        cpu = model(x, t, y).sample
        gpu = model.cuda()
        gpu.set_sparse_inference(False)
        masked = gpu(x.cuda(), t.cuda(), y.cuda()).sample.cpu()
        gpu.set_sparse_inference(True)
        sparse = gpu(x.cuda(), t.cuda(), y.cuda()).sample.cpu()
        gpu.set_sparse_inference(False)
        gpu.fuse_qkv_projections()
        fused = gpu(x.cuda(), t.cuda(), y.cuda()).sample.cpu()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fused_bf16 = gpu(x.cuda(), t.cuda(), y.cuda()).sample.float().cpu()
    assert rel_err(masked, cpu) <= 1e-4
    assert rel_err(sparse, masked) <= 1e-5
    assert rel_err(fused, masked) <= 1e-5
    assert rel_err(fused_bf16, masked) <= 5e-2


def test_training_step_on_cuda_bf16(randomize):
    """A few bf16-autocast training steps of MoH-DiT on the GPU: finite loss, routers get
    gradients, the loss goes down on a fixed batch."""
    model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-S/2-75", sample_size=16), std=0.02).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4, 16, 16, device="cuda")
    t = torch.randint(0, 1000, (8,), device="cuda")
    y = torch.randint(0, 1000, (8,), device="cuda")
    target = torch.randn(8, 8, 16, 16, device="cuda")
    losses = []
    for _ in range(10):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, t, y, output_load_balance_loss=True)
            loss = (out.sample.float() - target).pow(2).mean() + 0.01 * out.load_balance_loss
        loss.backward()
        router = model.transformer_blocks[0].attn1.router_routed.weight.grad
        assert router is not None and router.abs().sum() > 0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_training_steps_make_no_host_sync(tmp_path, monkeypatch):
    """The trainer's step loop on the GPU (bf16, fused AdamW, foreach EMA): after the first step
    (lazy initialisation may synchronise), no step waits for the GPU; torch raises on a
    synchronising call under sync debug mode "error"."""
    import numpy as np
    from PIL import Image

    import moh_dit.training.trainer as trainer
    from moh_dit.training import TrainConfig, train

    for c, name in enumerate(("a", "b")):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(np.full((16, 16, 3), 60 * (c + 1) + i, dtype=np.uint8)).save(tmp_path / "data" / name / f"{i}.png")
    real_step, steps = trainer.train_step, []

    def checked_step(*args, **kwargs):
        steps.append(1)
        if len(steps) > 1:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            return real_step(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(trainer, "train_step", checked_step)
    train(TrainConfig(preset="MoH-DiT-Tiny", output_dir=str(tmp_path / "run"), data_dir=str(tmp_path / "data"), vae="none",
                      image_size=16, max_steps=4, global_batch_size=4, checkpoint_every=4, num_workers=0,
                      report_to="none", log_every=4, mixed_precision="bf16"))
    assert len(steps) == 4
