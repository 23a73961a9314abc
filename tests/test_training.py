"""Training on tiny generated data: pixel space, a local tiny VAE, a latent cache, exact
resume after a crash, atomic checkpoints, corrupt images, bad arguments, divergence."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image
from safetensors.torch import load_file

import moh_dit.training as training
from moh_dit import MoHDiTTransformer2DModel
from moh_dit.diffusion import create_diffusion
from moh_dit.training import TrainConfig, TrainingDivergedError, find_latest_checkpoint, train

ROOT = Path(__file__).resolve().parents[1]


def make_image_folder(root: Path, classes=("blue", "red", "green"), per_class=6, size=20, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            arr = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
            arr[..., c % 3] += 180
            Image.fromarray(arr).save(root / name / f"{i}.png")
    return root


def tiny_vae(path: Path) -> Path:
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), latent_channels=4,
                        norm_num_groups=4, layers_per_block=1, sample_size=16)
    vae.save_pretrained(path)
    return path


def config(tmp_path, data, **kw) -> TrainConfig:
    base = dict(preset="MoH-DiT-Tiny", output_dir=str(tmp_path / "run"), data_dir=str(data), vae="none",
                image_size=16, max_steps=4, global_batch_size=4, checkpoint_every=2, num_workers=0,
                report_to="none", log_every=2, ema_decay=0.9)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data") / "images")


def test_pixel_space_training_writes_run_folder(tmp_path, data):
    final = train(config(tmp_path, data, sample_every=4, sample_steps=3))
    run = tmp_path / "run"
    model = MoHDiTTransformer2DModel.from_pretrained(final)
    assert model.config.class_names == ["blue", "green", "red"] and model.config.num_classes == 3
    assert model.config.in_channels == 3 and model.config.sample_size == 16
    assert json.loads((run / "class_index.json").read_text()) == {"blue": 0, "green": 1, "red": 2}
    assert json.loads((final / "class_index.json").read_text())["red"] == 2
    cfg = json.loads((run / "train_config.json").read_text())
    assert cfg["preset"] == "MoH-DiT-Tiny" and cfg["model_config"]["num_classes"] == 3
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-0000002", "step-0000004"]
    logs = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logs] == [2, 4]
    assert all(np.isfinite(entry[k]) for entry in logs for k in ("loss", "mse", "vb", "lb", "grad_norm"))
    assert logs[0]["lb"] > 0 and "head_balance_cv/layer_05" in logs[0]
    assert (run / "samples" / "step-0000004.png").exists()


def test_vae_and_latent_cache_training(tmp_path, data):
    vae_dir = tiny_vae(tmp_path / "vae")
    final = train(config(tmp_path, data, vae=str(vae_dir), max_steps=2, output_dir=str(tmp_path / "vae_run")))
    model = MoHDiTTransformer2DModel.from_pretrained(final)
    assert model.config.in_channels == 4 and model.config.sample_size == 8

    from moh_dit.latents import extract_latents

    extract_latents(data, vae_dir, image_size=16, output_dir=tmp_path / "latents", batch_size=4, num_workers=0, progress=False)
    final = train(config(tmp_path, None, data_dir=None, latents_dir=str(tmp_path / "latents"), max_steps=2,
                         output_dir=str(tmp_path / "latent_run")))
    model = MoHDiTTransformer2DModel.from_pretrained(final)
    assert model.config.in_channels == 4 and model.config.sample_size == 8 and model.config.num_classes == 3


def test_cache_and_on_the_fly_give_the_same_loss(tmp_path, data):
    """Same image, flip and posterior mean -> same diffusion loss, whichever path made the latent."""
    from moh_dit.data import ImageFolderDataset
    from moh_dit.latents import LatentDataset, extract_latents, load_vae

    vae_dir = tiny_vae(tmp_path / "vae")
    extract_latents(data, vae_dir, image_size=16, output_dir=tmp_path / "latents", batch_size=4, num_workers=0, progress=False)
    cache = LatentDataset(tmp_path / "latents", sample_posterior=False, seed=0)
    images = ImageFolderDataset(data, 16, seed=0)
    vae = load_vae(vae_dir)
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, in_channels=4, num_classes=3)
    torch.nn.init.normal_(model.proj_out_2.weight, std=0.1)
    diffusion = create_diffusion()
    keys = [(i, 1) for i in range(len(images))]
    x_cache = torch.stack([cache[k][0] for k in keys])
    with torch.no_grad():
        x_fly = vae.encode(torch.stack([images[k][0] for k in keys])).latent_dist.mean * vae.config.scaling_factor
        gen = torch.Generator().manual_seed(0)
        t = torch.randint(0, 1000, (len(keys),), generator=gen)
        noise = torch.randn(x_fly.shape, generator=gen)
        y = torch.tensor([images[k][1] for k in keys])
        losses = []
        for x in (x_cache, x_fly):
            x_t = diffusion.q_sample(x, t, noise)
            losses.append(diffusion.training_losses(model(x_t, t, y).sample, x, x_t, t, noise)["loss"])
    assert torch.allclose(losses[0], losses[1], atol=1e-4)


def test_loss_decreases_on_a_fixed_batch():
    torch.manual_seed(0)
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8).train()
    diffusion = create_diffusion()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 3, 8, 8)
    y = torch.arange(8) % 10
    t = torch.randint(0, 1000, (8,))
    noise = torch.randn_like(x)
    x_t = diffusion.q_sample(x, t, noise)
    losses = []
    for _ in range(40):
        out = model(x_t, t, y)
        loss = diffusion.training_losses(out.sample, x, x_t, t, noise)["loss"].mean() + 0.01 * out.load_balance_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


class _Crash(Exception):
    pass


def test_resume_is_exact_after_a_crash(tmp_path, data, monkeypatch):
    """6 steps in one run == 3 steps, a crash in step 4, then --resume latest to step 6."""
    one = config(tmp_path, data, max_steps=6, checkpoint_every=3, output_dir=str(tmp_path / "one"))
    train(one)

    real_update = training.update_ema
    calls = {"n": 0}

    def crashing_update(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # after step 4's optimiser update, before its EMA update
            raise _Crash
        return real_update(*args, **kwargs)

    monkeypatch.setattr(training, "update_ema", crashing_update)
    two = config(tmp_path, data, max_steps=6, checkpoint_every=3, output_dir=str(tmp_path / "two"))
    with pytest.raises(_Crash):
        train(two)
    assert find_latest_checkpoint(tmp_path / "two").name == "step-0000003"
    monkeypatch.setattr(training, "update_ema", real_update)
    torch.manual_seed(999)  # the restart's global RNG state must not matter
    train(config(tmp_path, data, max_steps=6, checkpoint_every=3, output_dir=str(tmp_path / "two"), resume="latest"))

    ema_one = load_file(tmp_path / "one" / "final" / "diffusion_pytorch_model.safetensors")
    ema_two = load_file(tmp_path / "two" / "final" / "diffusion_pytorch_model.safetensors")
    assert set(ema_one) == set(ema_two) and all(torch.equal(ema_one[k], ema_two[k]) for k in ema_one)
    w_one = torch.load(tmp_path / "one" / "checkpoints" / "step-0000006" / "pytorch_model.bin", weights_only=True)
    w_two = torch.load(tmp_path / "two" / "checkpoints" / "step-0000006" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(w_one[k], w_two[k]) for k in w_one)
    # and the weights really moved away from the step-3 checkpoint
    w_three = torch.load(tmp_path / "one" / "checkpoints" / "step-0000003" / "pytorch_model.bin", weights_only=True)
    assert any(not torch.equal(w_one[k], w_three[k]) for k in w_one)


def test_interrupted_checkpoint_is_ignored(tmp_path, data, monkeypatch):
    cfg = config(tmp_path, data, max_steps=2, checkpoint_every=2)
    train(cfg)
    ckpts = tmp_path / "run" / "checkpoints"
    # leftovers of crashed saves: a temporary folder and a final-named folder without marker
    (ckpts / ".step-0000009.tmp").mkdir()
    (ckpts / ".step-0000009.tmp" / "pytorch_model.bin").write_bytes(b"partial")
    (ckpts / "step-0000012").mkdir()
    (ckpts / "step-0000012" / "pytorch_model.bin").write_bytes(b"partial")
    assert find_latest_checkpoint(tmp_path / "run").name == "step-0000002"

    # a crash inside save_state leaves the previous checkpoint as the latest
    from accelerate import Accelerator

    def broken_save(self, output_dir, **kwargs):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "pytorch_model.bin").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(Accelerator, "save_state", broken_save)
    with pytest.raises(OSError, match="disk full"):
        train(config(tmp_path, data, max_steps=4, checkpoint_every=2, resume="latest"))
    assert find_latest_checkpoint(tmp_path / "run").name == "step-0000002"
    monkeypatch.undo()
    train(config(tmp_path, data, max_steps=4, checkpoint_every=2, resume="latest"))
    assert find_latest_checkpoint(tmp_path / "run").name == "step-0000004"


def test_corrupt_images_fail_or_are_skipped(tmp_path):
    data = make_image_folder(tmp_path / "data", per_class=4)
    (data / "red" / "broken.png").write_bytes(b"not a png at all")
    with pytest.raises(OSError, match="broken.png"):
        train(config(tmp_path, data, max_steps=12, checkpoint_every=12, output_dir=str(tmp_path / "a")))
    with pytest.warns(UserWarning, match="broken.png"):
        train(config(tmp_path, data, max_steps=12, checkpoint_every=12, on_corrupt="skip",
                     output_dir=str(tmp_path / "b")))
    logs = [json.loads(line) for line in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert logs[-1]["images_skipped"] >= 1


def test_nan_loss_stops_with_clear_error(tmp_path, data, monkeypatch):
    train(config(tmp_path, data, max_steps=2, checkpoint_every=2))
    real_forward = MoHDiTTransformer2DModel.forward

    def nan_forward(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        out.sample = out.sample * float("nan")
        return out

    monkeypatch.setattr(MoHDiTTransformer2DModel, "forward", nan_forward)
    with pytest.raises(TrainingDivergedError, match="step-0000002"):
        train(config(tmp_path, data, max_steps=4, checkpoint_every=2, resume="latest"))
    assert find_latest_checkpoint(tmp_path / "run").name == "step-0000002"


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(preset="MoH-DiT-Huge"), "Unknown preset"),
        (dict(data_dir="/nonexistent/folder"), "does not exist"),
        (dict(global_batch_size=0), "at least 1"),
        (dict(mixed_precision="fp8"), "mixed-precision"),
    ],
)
def test_bad_config_raises_before_work(tmp_path, data, kw, message):
    with pytest.raises(ValueError, match=message):
        train(config(tmp_path, data, **kw))
    assert not (tmp_path / "run").exists()


def test_batch_not_divisible_by_processes(tmp_path, data):
    with pytest.raises(ValueError, match="not divisible by the number of processes"):
        config(tmp_path, data, global_batch_size=10).validate(num_processes=4)


def test_empty_data_folder_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        train(config(tmp_path, tmp_path / "empty"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_cli_rejects_unknown_preset_and_dry_run_prints_config(tmp_path, data):
    script = ROOT / "scripts" / "train.py"
    res = subprocess.run([sys.executable, str(script), "--preset", "Nope", "--data-dir", str(data), "--output-dir",
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert res.returncode == 2 and "invalid choice" in res.stderr
    res = subprocess.run([sys.executable, str(script), "--preset", "DiT-Tiny", "--data-dir", str(data), "--vae", "none",
                          "--image-size", "16", "--output-dir", str(tmp_path / "o"), "--dry-run"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["preset"] == "DiT-Tiny" and not (tmp_path / "o").exists()
