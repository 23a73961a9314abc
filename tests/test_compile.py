"""torch.compile on the CPU: compiled sampling and training give the eager results, and a
compiled model's checkpoints hold the uncompiled model's keys. Compiling is slow on small
CPUs, so there are two compile tests, each of a tiny model."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from moh_dit.utils.speed import compile_model
from moh_dit.training import TrainConfig, train


def make_image_folder(root, per_class=2, size=8):
    rng = np.random.default_rng(0)
    for c, name in enumerate(("blue", "red", "green")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


@pytest.mark.slow
def test_compiled_pipeline_gives_the_eager_images(tiny_pipe):
    """``compile_model(pipe.transformer)``: same latents as eager (float rounding), the
    model's class, config and state-dict keys unchanged."""
    pipe = tiny_pipe(seed=3)
    kwargs = dict(class_labels=[0, 3, 7], guidance_scale=2.0, num_inference_steps=3, seeds=[0, 1, 2],
                  output_type="latent")
    eager = pipe(**kwargs)
    keys = list(pipe.transformer.state_dict())
    assert compile_model(pipe.transformer, dynamic=None) is pipe.transformer
    compiled = pipe(**kwargs)
    assert list(pipe.transformer.state_dict()) == keys and type(pipe.transformer).__name__ == "MoHDiTTransformer2DModel"
    # float rounding (inductor fuses and reorders), relative to the latents' scale
    assert (compiled.images - eager.images).abs().max() <= 1e-4 * eager.images.abs().max()
    assert all(torch.allclose(c, e, atol=1e-6) for c, e in zip(compiled.head_usage, eager.head_usage))


@pytest.mark.slow
def test_compiled_training_per_block_with_checkpointing_matches_eager(tmp_path):
    """--compile --compile-per-block with gradient checkpointing: the same losses and weights
    as the eager run to float tolerance, and checkpoints with the eager model's keys (no
    ``_orig_mod.``), so a run resumes with or without --compile."""
    data = make_image_folder(tmp_path / "data", per_class=2, size=8)
    base = dict(preset="MoH-DiT-Tiny", data_dir=str(data), vae="none", image_size=8, max_steps=2,
                global_batch_size=2, checkpoint_every=1, num_workers=0, report_to="none", log_every=1,
                ema_decay=0.9, gradient_checkpointing=True,
                # two blocks of one MoH layout (hs=2, K=1), so per-block compilation compiles one graph
                model_overrides=dict(num_layers=2, num_shared_heads=[2, 2], top_k=[1, 1]))
    train(TrainConfig(output_dir=str(tmp_path / "eager"), **base))
    train(TrainConfig(output_dir=str(tmp_path / "compiled"), compile=True, compile_per_block=True, **base))
    logs = {name: [json.loads(line) for line in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
            for name in ("eager", "compiled")}
    assert len(logs["eager"]) == len(logs["compiled"]) == 2
    for e, c in zip(logs["eager"], logs["compiled"]):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-4)
    ckpt = "checkpoints/step-0000002/model.safetensors"
    eager, compiled = load_file(tmp_path / "eager" / ckpt), load_file(tmp_path / "compiled" / ckpt)
    assert list(compiled) == list(eager) and not any("_orig_mod" in k for k in compiled)
    # Adam divides by sqrt(v): float rounding in a tiny gradient shows up in its update as a
    # fraction of the learning rate (1e-4), so weights agree to 1e-5 (a wrong gradient would move
    # them by up to 2e-4 in two steps).
    assert all(torch.allclose(compiled[k], eager[k], rtol=1e-4, atol=1e-5) for k in eager)


@pytest.mark.parametrize("flags, match", [
    (["--compile-mode", "reduce-overhead"], r"--compile-mode sets how --compile compiles; add --compile"),
    (["--compile", "--compile-mode", "fastest"], r"--compile-mode: invalid choice"),
])
def test_sample_compile_flags_are_refused_before_any_work(tmp_path, refuses, flags, match):
    refuses("sample", ["--model", str(tmp_path / "model"), "--output", str(tmp_path / "out"), *flags], match)
    assert not (tmp_path / "out").exists()
