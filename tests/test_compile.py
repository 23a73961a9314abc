"""torch.compile on the CPU: compiled sampling and training give the eager results, and a
compiled model's checkpoints hold the uncompiled model's keys. Compiling is slow on small
CPUs, so there are two compile tests, each of a tiny model."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

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
    """A compiled transformer (in place, ``nn.Module.compile``): same latents as eager (float
    rounding), the model's class, config and state-dict keys unchanged."""
    pipe = tiny_pipe(seed=3)
    kwargs = dict(class_labels=[0, 3, 7], guidance_scale=2.0, num_inference_steps=3, seeds=[0, 1, 2],
                  output_type="latent")
    eager = pipe(**kwargs)
    keys = list(pipe.transformer.state_dict())
    pipe.transformer.compile()
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


# A two-layer MoH-DiT-Tiny (one layer with shared heads, one without), so that whole-model
# compilation stays within a minute or so on a small CPU; 12 images in batches of 4, so every
# batch has the shape the graph was compiled for.
_FOLLOWS = dict(preset="MoH-DiT-Tiny", vae="none", image_size=8, global_batch_size=4, checkpoint_every=2,
                checkpoints_total_limit=None, num_workers=0, report_to="none", log_every=1, ema_decay=0.9,
                class_dropout=0.5, model_overrides=dict(num_layers=2, num_shared_heads=[2, 0], top_k=[1, 2]))


@pytest.fixture(scope="module")
def follow_data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("follow") / "data", per_class=4, size=8)


def _follow(out, data, **kw):
    train(TrainConfig(output_dir=str(out), data_dir=str(data), **{**_FOLLOWS, **kw}))
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def _assert_same_state(run, reference, step=4):
    """The model and EMA of ``run`` at ``step`` are ``reference``'s to float tolerance: rounding in a
    tiny gradient shows up in Adam's update as a fraction of the learning rate (1e-4), a wrong
    label, noise or timestep moves weights by up to 1e-4 per step."""
    folder = f"checkpoints/step-{step:07d}"
    for name in ("model.safetensors", "ema.safetensors"):
        ours, theirs = load_file(run / folder / name), load_file(reference / folder / name)
        assert list(ours) == list(theirs)
        assert all(torch.allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-5) for k in theirs), name


@pytest.mark.slow
def test_compiled_training_follows_eager_with_label_dropout(tmp_path, follow_data):
    """--compile (the whole model, torch's default mode) and eager training with the same seed and
    label dropout on (0.5): the same loss at every step to float tolerance and the same weights.
    The drop mask is drawn by the trainer; drawn inside the compiled graph it came from inductor's
    generator, and the losses parted from step 2 on (by 10%)."""
    eager = _follow(tmp_path / "eager", follow_data, max_steps=4)
    compiled = _follow(tmp_path / "compiled", follow_data, max_steps=4, compile=True)
    assert len(eager) == len(compiled) == 4
    assert compiled == pytest.approx(eager, rel=1e-5)
    _assert_same_state(tmp_path / "compiled", tmp_path / "eager")


@pytest.mark.slow
def test_a_run_resumes_with_or_without_compile_on_the_eager_trajectory(tmp_path, follow_data):
    """2 eager steps, then --resume latest with --compile to step 4; and 2 compiled steps, then an
    eager resume to step 4: both equal 4 eager steps (losses to 1e-5, weights and EMA)."""
    eager = _follow(tmp_path / "eager", follow_data, max_steps=4)
    _follow(tmp_path / "e2c", follow_data, max_steps=2)
    eager_then_compiled = _follow(tmp_path / "e2c", follow_data, max_steps=4, resume="latest", compile=True)
    _follow(tmp_path / "c2e", follow_data, max_steps=2, compile=True)
    compiled_then_eager = _follow(tmp_path / "c2e", follow_data, max_steps=4, resume="latest")
    for losses in (eager_then_compiled, compiled_then_eager):
        assert len(losses) == 4 and losses == pytest.approx(eager, rel=1e-5)
    _assert_same_state(tmp_path / "e2c", tmp_path / "eager")
    _assert_same_state(tmp_path / "c2e", tmp_path / "eager")
