"""Training on tiny generated data: pixel space, a local tiny VAE, a latent cache, exact
resume after a crash, atomic checkpoints, corrupt images, bad arguments, divergence."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.tracking import GeneralTracker
from PIL import Image
from safetensors.torch import load_file

import moh_dit.training as training
import moh_dit.training.checkpoints as training_checkpoints
import moh_dit.training.trainer as trainer
from moh_dit import MoHDiTTransformer2DModel
from moh_dit.diffusion.gaussian_diffusion import create_diffusion
from moh_dit.errors import DamagedFile, FolderInUse, InputNotFound, InvalidInput, OutputExists, TrainingDiverged
from moh_dit.training import TrainConfig, TrainingDivergedError, find_latest_checkpoint, preflight, train
from moh_dit.utils.output_folders import lock_path

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


def config(tmp_path, data, **kw) -> TrainConfig:
    base = dict(preset="MoH-DiT-Tiny", output_dir=str(tmp_path / "run"), data_dir=str(data), vae="none",
                image_size=16, max_steps=4, global_batch_size=4, checkpoint_every=2, num_workers=0,
                report_to="none", log_every=2, ema_decay=0.9)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data") / "images")


def _tree(root: Path):
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def refused(root: Path, kind, call, *parameters, mentions=()):
    """``call()`` raises ``kind`` whose ``parameters`` include ``parameters`` and whose message
    names each of ``mentions`` (paths, values) and no command-line flag, with nothing under
    ``root`` created, changed or removed. Returns the error."""
    before = _tree(root)
    with pytest.raises(kind) as raised:
        call()
    error = raised.value
    assert set(parameters) <= set(getattr(error, "parameters", ())), (error.parameters, str(error))
    assert all(str(fact) in str(error) for fact in mentions), (mentions, str(error))
    assert " --" not in str(error), str(error)
    assert _tree(root) == before, "the refused run wrote or changed files"
    return error


def test_pixel_space_training_writes_run_folder(tmp_path, data):
    final = train(config(tmp_path, data, sample_every=4, sample_steps=3))
    run = tmp_path / "run"
    model = MoHDiTTransformer2DModel.from_pretrained(final, subfolder="transformer")
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


def test_vae_and_latent_cache_training(tmp_path, data, tiny_vae):
    vae_dir = tmp_path / "vae"
    tiny_vae().save_pretrained(vae_dir)
    final = train(config(tmp_path, data, vae=str(vae_dir), max_steps=2, output_dir=str(tmp_path / "vae_run")))
    model = MoHDiTTransformer2DModel.from_pretrained(final, subfolder="transformer")
    assert model.config.in_channels == 4 and model.config.sample_size == 8

    from moh_dit.data.latents import extract_latents

    extract_latents(data, vae_dir, image_size=16, output_dir=tmp_path / "latents", batch_size=4, num_workers=0, progress=False)
    # The image size and VAE are the cache's: left out here, recorded as the cache's.
    final = train(config(tmp_path, None, data_dir=None, latents_dir=str(tmp_path / "latents"), max_steps=2,
                         output_dir=str(tmp_path / "latent_run"), vae=None, image_size=None))
    model = MoHDiTTransformer2DModel.from_pretrained(final, subfolder="transformer")
    assert model.config.in_channels == 4 and model.config.sample_size == 8 and model.config.num_classes == 3
    record = json.loads((tmp_path / "latent_run" / "train_config.json").read_text())
    assert record["image_size"] == 16 and record["vae"] == str(vae_dir)


def test_cache_and_on_the_fly_give_the_same_loss(tmp_path, data, tiny_vae):
    """Same image, flip and posterior mean -> same diffusion loss, whichever path made the latent."""
    from moh_dit.data.datasets import ImageFolderDataset
    from moh_dit.data.latents import LatentDataset, extract_latents, load_vae

    vae_dir = tmp_path / "vae"
    tiny_vae().save_pretrained(vae_dir)
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_resume_is_exact_after_a_crash(tmp_path, data, monkeypatch):
    """6 steps in one run == 3 steps, a crash in step 5, then --resume latest to step 6; the
    log holds every step once (the crashed run had logged step 4 after its last checkpoint)."""
    one = config(tmp_path, data, max_steps=6, checkpoint_every=3, log_every=1, output_dir=str(tmp_path / "one"))
    train(one)

    real_update = training.update_ema
    calls = {"n": 0}

    def crashing_update(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # after step 5's optimiser update, before its EMA update
            raise _Crash
        return real_update(*args, **kwargs)

    monkeypatch.setattr(trainer, "update_ema", crashing_update)
    two = config(tmp_path, data, max_steps=6, checkpoint_every=3, log_every=1, output_dir=str(tmp_path / "two"))
    with pytest.raises(_Crash):
        train(two)
    assert find_latest_checkpoint(tmp_path / "two").name == "step-0000003"
    assert log_steps(tmp_path / "two") == [1, 2, 3, 4]
    monkeypatch.setattr(trainer, "update_ema", real_update)
    torch.manual_seed(999)  # the restart's global RNG state must not matter
    train(config(tmp_path, data, max_steps=6, checkpoint_every=3, log_every=1, output_dir=str(tmp_path / "two"),
                 resume="latest"))
    assert log_steps(tmp_path / "two") == [1, 2, 3, 4, 5, 6]
    assert log_steps(tmp_path / "two", "head_usage.jsonl") == [1, 2, 3, 4, 5, 6]

    ema_one = load_file(tmp_path / "one" / "final" / "transformer" / "diffusion_pytorch_model.safetensors")
    ema_two = load_file(tmp_path / "two" / "final" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert set(ema_one) == set(ema_two) and all(torch.equal(ema_one[k], ema_two[k]) for k in ema_one)
    w_one = load_file(tmp_path / "one" / "checkpoints" / "step-0000006" / "model.safetensors")
    w_two = load_file(tmp_path / "two" / "checkpoints" / "step-0000006" / "model.safetensors")
    assert all(torch.equal(w_one[k], w_two[k]) for k in w_one)
    # and the weights really moved away from the step-3 checkpoint
    w_three = load_file(tmp_path / "one" / "checkpoints" / "step-0000003" / "model.safetensors")
    assert any(not torch.equal(w_one[k], w_three[k]) for k in w_one)
    # the optimiser state and the data position came back too (same files, byte for byte)
    for name in ("optimizer.safetensors", "train_state.json", "scheduler.json", "random_states_0.safetensors"):
        assert ((tmp_path / "one" / "checkpoints" / "step-0000006" / name).read_bytes()
                == (tmp_path / "two" / "checkpoints" / "step-0000006" / name).read_bytes()), name


@pytest.mark.slow
def test_interrupted_checkpoint_is_ignored(tmp_path, data, monkeypatch):
    cfg = config(tmp_path, data, max_steps=2, checkpoint_every=2)
    train(cfg)
    ckpts = tmp_path / "run" / "checkpoints"
    # leftovers of crashed saves: a temporary folder and a final-named folder without marker
    (ckpts / ".step-0000009.tmp").mkdir()
    (ckpts / ".step-0000009.tmp" / "model.safetensors").write_bytes(b"partial")
    (ckpts / "step-0000012").mkdir()
    (ckpts / "step-0000012" / "model.safetensors").write_bytes(b"partial")
    assert find_latest_checkpoint(tmp_path / "run").name == "step-0000002"

    # a crash while writing a checkpoint leaves the previous checkpoint as the latest
    def broken_save(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(training_checkpoints, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        train(config(tmp_path, data, max_steps=4, checkpoint_every=2, resume="latest"))
    assert find_latest_checkpoint(tmp_path / "run").name == "step-0000002"
    monkeypatch.undo()
    train(config(tmp_path, data, max_steps=4, checkpoint_every=2, resume="latest"))
    assert find_latest_checkpoint(tmp_path / "run").name == "step-0000004"
    assert (ckpts / "step-0000012" / "model.safetensors").read_bytes() == b"partial"  # not ours to delete


@pytest.mark.slow
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
    with pytest.raises(TrainingDivergedError, match="step-0000002"):  # the old name of TrainingDiverged
        train(config(tmp_path, data, max_steps=4, checkpoint_every=2, resume="latest"))
    assert find_latest_checkpoint(tmp_path / "run").name == "step-0000002"


@pytest.mark.parametrize("kw, parameter", [(dict(preset="MoH-DiT-Huge"), "preset"),
                                           (dict(data_dir="/nonexistent/folder"), "data_dir"),
                                           (dict(global_batch_size=0), "global_batch_size"),
                                           (dict(mixed_precision="fp8"), "mixed_precision")])
def test_bad_config_raises_before_work(tmp_path, data, kw, parameter):
    refused(tmp_path, ValueError, lambda: train(config(tmp_path, data, **kw)), parameter, mentions=kw.values())
    assert not (tmp_path / "run").exists()


def test_batch_not_divisible_by_processes(tmp_path, data):
    refused(tmp_path, InvalidInput, lambda: config(tmp_path, data, global_batch_size=10).validate(num_processes=4),
            "global_batch_size", mentions=("global_batch_size 10", "processes (4)"))


def test_a_python_caller_is_told_the_parameter_and_the_command_line_the_flag(tmp_path, data, load_script, capsys):
    """train() and TrainConfig name the option as the Python caller wrote it (the field, listed
    in the error's parameters); moh-dit train says the same with its flag, whose destination
    is that field's name."""
    error = refused(tmp_path, InvalidInput, lambda: train(config(tmp_path, data, global_batch_size=0)),
                    "global_batch_size")
    assert "global_batch_size must be at least 1" in str(error)
    error = refused(tmp_path, InvalidInput, config(tmp_path, data, checkpoints_total_limit=-1).validate,
                    "checkpoints_total_limit")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_config.json").write_text("{}")  # a run lives there
    error = refused(tmp_path, OutputExists, lambda: train(config(tmp_path, data)), "output_dir", "resume")
    assert str(tmp_path / "run") in str(error) and "resume='latest'" in str(error)

    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(tmp_path / "new", data, "--global-batch-size", 0)) == 1
    err = capsys.readouterr().err
    assert "error: --global-batch-size must be at least 1" in err and "global_batch_size" not in err, err
    assert run_cli_train(load_script, cli_args(tmp_path / "run", data)) == 1
    err = capsys.readouterr().err
    assert f"--output-dir {tmp_path / 'run'} already holds a run" in err and "--resume='latest'" in err, err
    assert "output_dir" not in err and "resume=" not in err.replace("--resume=", ""), err
    # every option's flag has the option's name as its destination: how the command finds the flag
    from moh_dit.utils.cli import ArgumentParser

    flags = ArgumentParser.last_flags
    assert all(flags[name] == load_script("train").FLAGS[name].get("flag", "--" + name.replace("_", "-"))
               for name in load_script("train").FLAGS)


def test_options_are_checked_once_per_run(tmp_path, data, monkeypatch):
    real_validate, calls = TrainConfig.validate, []
    monkeypatch.setattr(TrainConfig, "validate", lambda self, *a, **k: (calls.append(a or k), real_validate(self, *a, **k)))
    train(config(tmp_path, data, max_steps=1, checkpoint_every=1))
    assert len(calls) == 1


def test_script_flags_default_to_train_config(load_script):
    """No flag but the required ones gives TrainConfig's own defaults; every flag sets its field."""
    script = load_script("train")
    required = ["--preset", "DiT-Tiny", "--data-dir", "d", "--output-dir", "o"]
    assert script.config_from_args(script.parse_args(required)) == TrainConfig("DiT-Tiny", "o", data_dir="d")
    cfg = script.config_from_args(script.parse_args(required + [
        "--no-tf32", "--no-flip", "--checkpoints-total-limit", "0", "--max-grad-norm", "1.5", "--seed", "3",
        "--compile", "--compile-mode", "default", "--on-corrupt", "skip", "--image-size", "32"]))
    assert (cfg.allow_tf32, cfg.random_flip, cfg.checkpoints_total_limit, cfg.max_grad_norm, cfg.seed) == \
        (False, False, None, 1.5, 3)
    assert (cfg.compile, cfg.compile_mode, cfg.on_corrupt, cfg.image_size) == (True, "default", "skip", 32)


def test_empty_data_folder_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        train(config(tmp_path, tmp_path / "empty"))
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
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


# --------------------------------------------------------------------------------------
# One run per folder, safe checkpoints, integrity, pruning
# --------------------------------------------------------------------------------------


def cli_args(out, data, *extra):
    """scripts/train.py flags of the tiny run used below (pixel space, 16 px, 4 steps)."""
    return ["--preset", "MoH-DiT-Tiny", "--data-dir", str(data), "--vae", "none", "--image-size", "16",
            "--output-dir", str(out), "--max-steps", "4", "--global-batch-size", "4", "--checkpoint-every", "2",
            "--num-workers", "0", "--report-to", "none", "--log-every", "1", "--ema-decay", "0.9", *map(str, extra)]


def run_cli_train(load_script, argv):
    return load_script("train").cli([str(a) for a in argv])


def log_steps(run: Path, name="train_log.jsonl"):
    return [json.loads(line)["step"] for line in (run / name).read_text().splitlines()]


def tree_state(root: Path):
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.name != ".lock"}


def test_second_run_into_a_busy_folder_is_refused(tmp_path, data, monkeypatch):
    """While a run trains, a second one into its output_dir stops at once naming the holder,
    with or without resume, and the running one finishes intact."""
    import os
    import socket

    run = tmp_path / "run"
    real_update = training.update_ema
    seen = {}

    def update_and_intrude(*args, **kwargs):
        real_update(*args, **kwargs)
        if not seen and find_latest_checkpoint(run) is not None:  # after the step-2 checkpoint
            seen["inside"] = True  # (today's code would run the intruder, which comes back here)
            before = tree_state(run)
            for i, resume in enumerate((None, "latest")):
                seen[i] = str(refused(run, FolderInUse, lambda: train(config(tmp_path, data, max_steps=6,
                                                                             resume=resume)),
                                      "output_dir", mentions=(run, "being written by another command (moh-dit train", f"pid {os.getpid()}")))
            assert tree_state(run) == before

    monkeypatch.setattr(trainer, "update_ema", update_and_intrude)
    train(config(tmp_path, data, log_every=1))
    assert socket.gethostname() in seen[0] and "started" in seen[0]
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-0000002", "step-0000004"]
    assert log_steps(run) == [1, 2, 3, 4]
    assert json.loads((run / "train_config.json").read_text())["max_steps"] == 4


@pytest.mark.parametrize("leftover", ["finished", "train_config", "final", "checkpoint"])
@pytest.mark.slow
def test_starting_over_an_existing_run_is_refused(tmp_path, data, leftover):
    """Without resume, a folder holding a run (or any part of one) is never reused."""
    run = tmp_path / "run"
    train(config(tmp_path, data, max_steps=4))
    if leftover == "train_config":
        import shutil
        shutil.rmtree(run / "checkpoints"), shutil.rmtree(run / "final")
    elif leftover == "final":
        import shutil
        shutil.rmtree(run / "checkpoints"), (run / "train_config.json").unlink()
    elif leftover == "checkpoint":
        import shutil
        shutil.rmtree(run / "final"), (run / "train_config.json").unlink()
    refused(tmp_path, OutputExists, lambda: train(config(tmp_path, data, max_steps=2)), "output_dir", "resume",
            mentions=(run,))


def test_rerun_of_a_finished_command_keeps_the_run(tmp_path, data, load_script):
    """The finished run's final/ and checkpoints survive a refused rerun; --resume latest continues it."""
    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data)) == 0
    final_before = (run / "final" / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 2)) == 1
    assert (run / "final" / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == final_before
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 6, "--resume", "latest")) == 0
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-0000004", "step-0000006"]
    assert log_steps(run) == [1, 2, 3, 4, 5, 6]


def test_keep_all_checkpoints_with_limit_zero(tmp_path, data, load_script):
    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 6, "--checkpoints-total-limit", 0)) == 0
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-0000002", "step-0000004",
                                                                         "step-0000006"]


class _Planted:
    """A pickle that, when unpickled, creates the file ``path``: planted code running."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant(folder: Path, name: str, marker: Path) -> None:
    torch.save({"state": _Planted(marker)}, folder / name)


@pytest.mark.slow
def test_resume_never_unpickles_planted_code(tmp_path, data, load_script):
    """A planted custom_checkpoint_*.pkl is never read; resume from latest and from the path."""
    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 2)) == 0
    ckpt = run / "checkpoints" / "step-0000002"
    marker = tmp_path / "code_ran"
    for i in range(2):  # where accelerate's register_for_checkpointing puts custom state
        _plant(ckpt, f"custom_checkpoint_{i}.pkl", marker)
    try:
        status = run_cli_train(load_script, cli_args(run, data, "--max-steps", 3, "--resume", "latest"))
    except Exception:  # today's code: the planted object reaches load_state_dict
        status = "raised"
    assert not marker.exists(), "the planted pickle ran"
    assert status == 0
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 4, "--resume",
                                               run / "checkpoints" / "step-0000003")) == 0
    assert not marker.exists()


def test_resume_with_another_preset_or_data_is_refused(tmp_path, data, load_script):
    """The run record and logs stay as they were; the message names the option and both values."""
    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 2)) == 0
    other = make_image_folder(tmp_path / "other", classes=("a", "b", "c"))

    def resumed(**kw):
        return lambda: train(config(tmp_path, kw.pop("data", data), resume="latest", **kw))

    refused(tmp_path, InvalidInput, resumed(preset="DiT-Tiny"), "preset", mentions=("DiT-Tiny", "MoH-DiT-Tiny"))
    refused(tmp_path, InvalidInput, resumed(data=other), "data_dir", mentions=(other, data))
    refused(tmp_path, InvalidInput, resumed(image_size=8), "image_size", mentions=("sample_size",))
    # other latents of the same data
    refused(tmp_path, InvalidInput, resumed(vae="stabilityai/sd-vae-ft-mse"), "vae",
            mentions=("stabilityai/sd-vae-ft-mse", "vae none"))
    assert json.loads((run / "train_config.json").read_text())["preset"] == "MoH-DiT-Tiny"


def _weights_file(ckpt: Path) -> Path:
    return next(ckpt / n for n in ("model.safetensors", "pytorch_model.bin") if (ckpt / n).exists())


@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_or_is_named(tmp_path, data, load_script, capsys):
    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data)) == 0
    step4 = run / "checkpoints" / "step-0000004"
    weights = _weights_file(step4)
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated by a full disk
    truncated = weights.stat().st_size
    refused(tmp_path, DamagedFile, lambda: train(config(tmp_path, data, max_steps=6, resume=str(step4))), "resume",
            mentions=(weights,))

    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 6, "--resume", "latest")) == 0
    err = capsys.readouterr().err
    assert re.search(r"step-0000004.*damaged.*step-0000002", err, re.S), err
    assert log_steps(run) == [1, 2, 3, 4, 5, 6]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-0000004", "step-0000004.damaged", "step-0000006"]  # the damaged one set aside, kept
    assert (run / "checkpoints" / names[1] / weights.name).stat().st_size == truncated


def test_every_damage_to_a_checkpoint_is_detected(tmp_path, data, load_script):
    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 2)) == 0
    ckpt = run / "checkpoints" / "step-0000002"
    marker = json.loads((ckpt / "checkpoint.json").read_text())
    assert {"model.safetensors", "ema.safetensors", "train_state.json"} <= set(marker["files"])
    for name in sorted(marker["files"]):
        original = (ckpt / name).read_bytes()
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 1  # same size, one bit off
        for damaged in (bytes(flipped), original + b"\0", None):
            if damaged is None:
                (ckpt / name).unlink()
            else:
                (ckpt / name).write_bytes(damaged)
            refused(tmp_path, DamagedFile, lambda: train(config(tmp_path, data, resume=str(ckpt))), "resume",
                    mentions=(ckpt / name,))
            (ckpt / name).write_bytes(original)
    (ckpt / "checkpoint.json").write_text("{ not json")
    for resume in (str(ckpt), "latest"):
        refused(tmp_path, DamagedFile, lambda: train(config(tmp_path, data, resume=resume)), "resume",
                mentions=(ckpt / "checkpoint.json",))


@pytest.mark.slow
def test_no_file_of_a_checkpoint_is_unpickled_unsafely(tmp_path, data, load_script):
    """Planted pickles under every name the checkpoint holds, with the marker's hashes made
    to match: the resume fails naming the file (or ignores it) but never runs the code."""
    import hashlib

    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 2)) == 0
    ckpt = run / "checkpoints" / "step-0000002"
    code_ran = tmp_path.parent / f"{tmp_path.name}_code_ran"
    names = sorted(json.loads((ckpt / "checkpoint.json").read_text())["files"])
    for name in names + ["checkpoint.json", "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "optimizer.bin",
                         "scheduler.bin", "random_states_0.pkl", "pytorch_model.bin"]:
        original = (ckpt / name).read_bytes() if (ckpt / name).exists() else None
        marker_text = (ckpt / "checkpoint.json").read_text()
        _plant(ckpt, name, code_ran)
        marker = json.loads(marker_text)
        if name in marker["files"]:
            blob = (ckpt / name).read_bytes()
            marker["files"][name] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
            (ckpt / "checkpoint.json").write_text(json.dumps(marker))
        for resume in ("latest", ckpt):
            status = run_cli_train(load_script, cli_args(run, data, "--max-steps", 2, "--resume", resume))
            assert not code_ran.exists(), f"planted {name} ran"
            assert status == (1 if name in marker["files"] or name == "checkpoint.json" else 0), name
        (ckpt / "checkpoint.json").write_text(marker_text)
        if original is None:
            (ckpt / name).unlink()
        else:
            (ckpt / name).write_bytes(original)


def test_dry_run_writes_nothing_and_takes_no_lock(tmp_path, data, load_script, capsys):
    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 2)) == 0
    before = {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")}
    assert run_cli_train(load_script, cli_args(run, data, "--resume", "latest", "--dry-run")) == 0
    assert {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")} == before
    assert run_cli_train(load_script, cli_args(tmp_path / "new", data, "--dry-run")) == 0
    assert not (tmp_path / "new").exists()


@pytest.fixture
def bad_inputs(tmp_path):
    (tmp_path / "a_file.txt").write_text("not a folder")
    return tmp_path


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("options, parameter", [
    (dict(preset="MoH-DiT-Huge"), "preset"),
    (dict(data_dir="{tmp}/missing"), "data_dir"),
    (dict(data_dir="{tmp}/a_file.txt"), "data_dir"),
    (dict(data_dir=None, latents_dir="{tmp}/missing"), "latents_dir"),
    (dict(latents_dir="{tmp}/missing"), "data_dir"),  # and latents_dir: one of the two
    (dict(vae="{tmp}/a_file.txt"), "vae"),
    (dict(vae_subfolder="vae"), "vae_subfolder"),
    (dict(image_size=0), "image_size"),
    (dict(image_size=-16), "image_size"),
    (dict(output_dir="{tmp}/a_file.txt"), "output_dir"),
    (dict(max_steps=0), "max_steps"),
    (dict(max_steps=-5), "max_steps"),
    (dict(global_batch_size=0), "global_batch_size"),
    (dict(learning_rate=0), "learning_rate"),
    (dict(learning_rate=-1e-4), "learning_rate"),
    (dict(learning_rate=NAN), "learning_rate"),
    (dict(learning_rate=INF), "learning_rate"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(weight_decay=NAN), "weight_decay"),
    (dict(weight_decay=INF), "weight_decay"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(max_grad_norm=0), "max_grad_norm"),
    (dict(max_grad_norm=-1), "max_grad_norm"),
    (dict(max_grad_norm=NAN), "max_grad_norm"),
    (dict(max_grad_norm=INF), "max_grad_norm"),
    (dict(checkpoint_every=0), "checkpoint_every"),
    (dict(checkpoints_total_limit=-1), "checkpoints_total_limit"),
    (dict(resume="{tmp}/missing"), "resume"),
    (dict(resume="{tmp}/a_file.txt"), "resume"),
    (dict(mixed_precision="fp8"), "mixed_precision"),
    (dict(seed=-1), "seed"),
    (dict(seed=2 ** 40), "seed"),
    (dict(lb_coeff=-0.01), "lb_coeff"),
    (dict(lb_coeff=NAN), "lb_coeff"),
    (dict(lb_coeff=INF), "lb_coeff"),
    (dict(ema_decay=1), "ema_decay"),
    (dict(ema_decay=-0.5), "ema_decay"),
    (dict(ema_decay=NAN), "ema_decay"),
    (dict(class_dropout=1), "class_dropout"),
    (dict(class_dropout=-0.1), "class_dropout"),
    (dict(class_dropout=NAN), "class_dropout"),
    (dict(num_workers=-1), "num_workers"),
    (dict(on_corrupt="ignore"), "on_corrupt"),
    (dict(log_every=0), "log_every"),
    (dict(sample_every=-1), "sample_every"),
    (dict(sample_every=2, sample_steps=0), "sample_steps"),
    (dict(sample_every=2, sample_steps=5000), "sample_steps"),
    (dict(report_to="mlflow"), "report_to"),
    (dict(init_from="{tmp}/missing"), "init_from"),
    (dict(init_from="{tmp}", resume="latest"), "resume"),  # and init_from: one of the two
    (dict(router_warmup_steps=-1), "router_warmup_steps"),
    (dict(preset="DiT-Tiny", router_warmup_steps=2), "router_warmup_steps"),  # a dense DiT has no routers
    (dict(compile_mode="default", compile_per_block=True), "compile"),  # they set how compile compiles
    (dict(compile_mode="max-autotune"), "compile"),
    (dict(compile=True, compile_mode="fastest"), "compile_mode"),
    (dict(train_batch_size=0), "train_batch_size"),
    (dict(train_batch_size=3), "train_batch_size"),  # x 1 process x 1 pass is not the global batch 4
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    (dict(gradient_accumulation_steps=3), "gradient_accumulation_steps"),  # 4 images do not split into 3
    (dict(lr_scheduler="piecewise_constant"), "lr_scheduler"),
    (dict(ema_power=0.75), "ema_warmup"),  # it shapes ema_warmup's schedule, which is off
    (dict(ema_warmup=True, ema_inv_gamma=0), "ema_inv_gamma"),
    (dict(ema_warmup=True, ema_power=NAN), "ema_power"),
])
def test_every_bad_option_is_refused_before_any_work(bad_inputs, data, options, parameter):
    tmp = bad_inputs
    options = {k: v.format(tmp=tmp) if isinstance(v, str) else v for k, v in options.items()}
    value = options.get(parameter)
    refused(tmp, InvalidInput, lambda: train(config(tmp, data, **options)), parameter,
            mentions=[value] if isinstance(value, str) and value.startswith(str(tmp)) else [])
    assert not (tmp / "run").exists()


@pytest.mark.parametrize("flags, match", [
    (["--preset", "MoH-DiT-Huge"], r"--preset: invalid choice"),
    (["--latents-dir", "{tmp}/missing"], r"--latents-dir: not allowed with argument --data-dir"),
    (["--image-size", "big"], r"--image-size: invalid int"),
    (["--mixed-precision", "fp8"], r"--mixed-precision: invalid choice"),
    (["--on-corrupt", "ignore"], r"--on-corrupt: invalid choice"),
    (["--report-to", "mlflow"], r"--report-to: invalid choice"),
    (["--compile", "--compile-mode", "fastest"], r"--compile-mode: invalid choice"),
    (["--lr-scheduler", "piecewise_constant"], r"--lr-scheduler: invalid choice"),
    (["--max-steps", 0], r"error: --max-steps must be at least 1, got 0"),  # the library's, with the flag
    (["--train_batch_size", 3], r"error: --train-batch-size 3 .*--global-batch-size is 4"),
])
def test_the_command_line_refuses_bad_flags_by_their_names(bad_inputs, data, refuses, flags, match):
    tmp = bad_inputs
    refuses("train", cli_args(tmp / "run", data) + [str(f).format(tmp=tmp) for f in flags], match)
    assert not (tmp / "run").exists()


@pytest.mark.slow
def test_rotation_only_removes_this_runs_older_checkpoints(tmp_path, data, load_script, capsys):
    """Checkpoints of another run copied into the folder are skipped by --resume latest and
    never rotated away; this run keeps its newest --checkpoints-total-limit."""
    import shutil

    assert run_cli_train(load_script, cli_args(tmp_path / "other", data, "--max-steps", 2, "--seed", 0)) == 0
    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 2)) == 0
    shutil.copytree(tmp_path / "other" / "checkpoints" / "step-0000002", run / "checkpoints" / "step-0000001")
    shutil.copytree(tmp_path / "other" / "checkpoints" / "step-0000002", run / "checkpoints" / "step-0000009")
    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 6, "--resume", "latest",
                                               "--checkpoints-total-limit", 1)) == 0
    assert re.search(r"step-0000009 belongs to another run", capsys.readouterr().err)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000001", "step-0000006", "step-0000009"]
    assert log_steps(run) == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_resume_from_an_older_checkpoint_into_the_same_folder_is_refused(tmp_path, data, load_script):
    """It would leave the newer checkpoints of the first history for a later resume="latest"."""
    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 4, "--checkpoints-total-limit", 0)) == 0
    older = run / "checkpoints" / "step-0000002"
    refused(tmp_path, InvalidInput, lambda: train(config(tmp_path, data, max_steps=6, resume=str(older))), "resume",
            "output_dir", mentions=(older, "step-0000004"))
    refused(tmp_path, InvalidInput, lambda: train(config(tmp_path, data, max_steps=3, resume="latest")), "max_steps",
            mentions=("max_steps 3", "step 4"))
    assert run_cli_train(load_script, cli_args(tmp_path / "branch", data, "--max-steps", 3, "--resume", older)) == 0
    assert sorted(p.name for p in (tmp_path / "branch" / "checkpoints").iterdir()) == ["step-0000003"]


def test_resume_takes_diffusers_checkpoint_name(tmp_path, data, load_script, capsys):
    """--resume_from_checkpoint checkpoint-2 (diffusers' examples' name; also step-2) resumes the
    run's checkpoint of step 2; a step without a checkpoint is refused, naming the steps there."""
    run = tmp_path / "run"
    train(config(tmp_path, data, max_steps=2))
    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(run, data, "--resume_from_checkpoint", "checkpoint-2", "--dry-run")) == 0
    assert re.search(r"would resume from .*checkpoints/step-0000002 \(step 2\)", capsys.readouterr().err)
    refused(tmp_path, InputNotFound, lambda: train(config(tmp_path, data, resume="checkpoint-3")), "resume",
            mentions=("checkpoint-3", run / "checkpoints", "step 3", "its steps: 2"))
    train(config(tmp_path, data, resume="step-2"))
    assert log_steps(run) == [2, 4] and find_latest_checkpoint(run).name == "step-0000004"


def test_a_file_system_without_locks_is_a_clear_error(tmp_path, data, load_script, monkeypatch, capsys):
    """NFS mounted without lock support answers flock with ENOLCK: stop, naming the lock file."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(tmp_path / "run", data)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(r"cannot lock .*/\.run\.lock.*does not support file locks", err), err
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "train_config.json").exists()


# ------------------------------------------------------------------ --init-from and router warm-up
@pytest.fixture(scope="module")
def upcycled(tmp_path_factory, randomize):
    """A randomized dense DiT-Tiny for the 16 px, 3-class data, upcycled to MoH-DiT-Tiny-up75."""
    from moh_dit.hub.upcycle import save_upcycled, upcycle

    dense = randomize(MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=16, num_classes=3,
                                                            class_names=["blue", "green", "red"]), seed=7)
    moh, report = upcycle(dense, 0.75)
    return save_upcycled(moh, report, tmp_path_factory.mktemp("up") / "model")


def _weights(folder: Path, name="model.safetensors"):
    return load_file(folder / name)


def test_init_from_with_router_warmup_trains_only_routers_then_all(tmp_path, data, upcycled):
    """Steps 1-2 move only the routers (every other weight is the upcycled one, bit for bit; the
    EMA starts from them); steps 3-4 move everything."""
    init = load_file(upcycled / "diffusion_pytorch_model.safetensors")
    train(config(tmp_path, data, preset="MoH-DiT-Tiny-up75", init_from=str(upcycled), router_warmup_steps=2,
                 learning_rate=1e-3))
    ckpts = tmp_path / "run" / "checkpoints"
    two, four = _weights(ckpts / "step-0000002"), _weights(ckpts / "step-0000004")
    routers = [k for k in init if ".router_" in k]
    assert routers and all(torch.count_nonzero(init[k]) == 0 for k in routers)
    assert all(torch.equal(two[k], init[k]) for k in init if k not in routers)
    assert all(torch.count_nonzero(two[k]) > 0 for k in routers)
    assert all(not torch.equal(four[k], init[k]) for k in init if k.endswith("to_q.weight"))
    ema = _weights(ckpts / "step-0000002", "ema.safetensors")
    assert all(torch.allclose(ema[k], init[k], rtol=1e-6, atol=1e-7) for k in init if k not in routers)
    record = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert record["init_from"] == str(upcycled) and record["router_warmup_steps"] == 2


@pytest.mark.slow
def test_router_warmup_survives_an_exact_resume(tmp_path, data, upcycled):
    """4 steps straight == 1 step (inside the warm-up), then --resume latest to 4 (across its end)."""
    kw = dict(preset="MoH-DiT-Tiny-up75", router_warmup_steps=2, learning_rate=1e-3, checkpoint_every=1)
    train(config(tmp_path, data, output_dir=str(tmp_path / "one"), init_from=str(upcycled), **kw))
    train(config(tmp_path, data, output_dir=str(tmp_path / "two"), init_from=str(upcycled), **dict(kw, max_steps=1)))
    train(config(tmp_path, data, output_dir=str(tmp_path / "two"), resume="latest", **kw))
    for name in ("model.safetensors", "ema.safetensors", "optimizer.safetensors"):
        assert ((tmp_path / "one" / "checkpoints" / "step-0000004" / name).read_bytes()
                == (tmp_path / "two" / "checkpoints" / "step-0000004" / name).read_bytes()), name
    refused(tmp_path, InvalidInput, lambda: train(config(tmp_path, data, output_dir=str(tmp_path / "two"),
                                                         resume="latest", **dict(kw, router_warmup_steps=3,
                                                                                 max_steps=5))),
            "router_warmup_steps", mentions=("router_warmup_steps 3", "router_warmup_steps 2"))


def test_init_from_is_checked_against_the_preset(tmp_path, data, upcycled, load_script, monkeypatch):
    refused(tmp_path, InvalidInput, lambda: train(config(tmp_path, data, init_from=str(upcycled),
                                                         preset="MoH-DiT-Tiny-up90")),
            "init_from", "preset", mentions=(upcycled, "MoH-DiT-Tiny-up90", "num_shared_heads"))
    refused(tmp_path, InvalidInput, lambda: train(config(tmp_path, data, init_from=str(upcycled), image_size=8)),
            "init_from", mentions=(upcycled, "sample_size 16 there, 8 here"))
    # same layout under its other name: accepted
    assert run_cli_train(load_script, cli_args(tmp_path / "ok", data, "--init-from", upcycled, "--max-steps", 1)) == 0

    def crash(*args, **kwargs):
        raise _Crash

    monkeypatch.setattr(trainer, "update_ema", crash)
    with pytest.raises(_Crash):  # dies before its first checkpoint
        train(config(tmp_path, data, output_dir=str(tmp_path / "crashed"), init_from=str(upcycled)))
    monkeypatch.undo()
    refused(tmp_path, InvalidInput, lambda: train(config(tmp_path, data, output_dir=str(tmp_path / "crashed"),
                                                         resume="latest")),
            "init_from", "output_dir", mentions=(tmp_path / "crashed", upcycled, "no checkpoint"))


def _loop_ema(ema, model, decay):
    """The per-parameter EMA update that update_ema replaced, as the reference."""
    with torch.no_grad():
        ema_params = dict(ema.named_parameters())
        for name, param in model.named_parameters():
            ema_params[name].mul_(decay).add_(param.detach().to(ema_params[name].dtype), alpha=1 - decay)


@pytest.mark.parametrize("decay", [0.9999, 0.9, 0.0])
def test_foreach_ema_is_bit_identical_to_the_per_parameter_loop(decay):
    import copy

    torch.manual_seed(0)
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, in_channels=3, num_classes=3)
    ema_a = copy.deepcopy(model).requires_grad_(False)
    ema_b = copy.deepcopy(model).requires_grad_(False)
    for _ in range(3):  # the model moves between updates, as in training
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        trainer.update_ema(ema_a, model, decay)
        _loop_ema(ema_b, model, decay)
    a, b = ema_a.state_dict(), ema_b.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], model.state_dict()[k]) for k in a) or decay == 0.0
    if decay == 0.0:
        assert all(torch.equal(a[k], model.state_dict()[k]) for k in a)


def test_nan_loss_between_checks_is_caught_before_any_checkpoint_with_its_step(tmp_path, data, monkeypatch):
    """The finite check runs at log / checkpoint steps only (no per-step host sync), yet the
    first NaN step is the one named, and nothing is logged or checkpointed after it."""
    real_forward = MoHDiTTransformer2DModel.forward
    calls = {"n": 0}

    def nan_at_step_3(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        if self.training:
            calls["n"] += 1
            if calls["n"] >= 3:  # step 3 and every later one
                out.sample = out.sample * float("nan")
        return out

    monkeypatch.setattr(MoHDiTTransformer2DModel, "forward", nan_at_step_3)
    checks = []  # the steps done when the loss is checked
    real_check = trainer._stop_if_diverged
    monkeypatch.setattr(trainer, "_stop_if_diverged", lambda *args: (checks.append(calls["n"]), real_check(*args)))
    with pytest.raises(TrainingDiverged) as raised:
        train(config(tmp_path, data, max_steps=8, checkpoint_every=4, log_every=4))
    assert "nan at step 3 " in str(raised.value) and "checkpoint is none" in str(raised.value)
    assert checks == [4]  # steps 1-3 never read the loss on the host
    assert find_latest_checkpoint(tmp_path / "run") is None
    assert not (tmp_path / "run" / "train_log.jsonl").exists()


def test_training_steps_between_logs_never_read_a_tensor_on_the_host(tmp_path, data, monkeypatch):
    """Between log / checkpoint steps the loop asks nothing of the device (on a GPU each such
    read waits for it; tests/test_cuda.py checks the same under CUDA's sync debug mode)."""
    reads = []
    real_step = trainer._train_step

    def reader(name, real):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            # AdamW reads its step counters, which live on the CPU even when training on a GPU
            if "torch/optim" not in caller.replace("\\", "/"):
                reads.append(f"{name} in {caller}")
            return real(self, *args, **kwargs)
        return read

    def watched_step(*args, **kwargs):
        names = ("item", "tolist", "__bool__", "__float__")
        saved = {n: getattr(torch.Tensor, n) for n in names}
        for n in names:
            monkeypatch.setattr(torch.Tensor, n, reader(n, saved[n]))
        try:
            return real_step(*args, **kwargs)
        finally:
            for n in names:
                monkeypatch.setattr(torch.Tensor, n, saved[n])

    monkeypatch.setattr(trainer, "_train_step", watched_step)
    train(config(tmp_path, data, max_steps=3, checkpoint_every=3, log_every=3))
    assert reads == []
    log = json.loads((tmp_path / "run" / "train_log.jsonl").read_text().splitlines()[-1])
    assert log["images_per_sec"] > 0 and log["steps_per_sec"] > 0 and 0 < log["mfu"] < 1


# ------------------------------------------------------------------ diffusers' and accelerate's dialect
DIFFUSERS_SPELLINGS = [  # diffusers' example-script flag -> this trainer's flag, with a value
    ("--train_data_dir", "--data-dir", "d"), ("--resolution", "--image-size", "32"),
    ("--train_batch_size", "--train-batch-size", "8"), ("--max_train_steps", "--max-steps", "7"),
    ("--checkpointing_steps", "--checkpoint-every", "3"), ("--lr_warmup_steps", "--warmup-steps", "5"),
    ("--resume_from_checkpoint", "--resume", "latest"), ("--dataloader_num_workers", "--num-workers", "1"),
    ("--output_dir", "--output-dir", "o"), ("--mixed_precision", "--mixed-precision", "bf16"),
    ("--gradient_accumulation_steps", "--gradient-accumulation-steps", "2"),
    ("--lr_scheduler", "--lr-scheduler", "cosine"), ("--report_to", "--report-to", "none"),
]


def test_diffusers_example_flag_names_set_the_same_options(load_script):
    script = load_script("train")
    base = ["--preset", "DiT-Tiny"]
    theirs = script.config_from_args(script.parse_args(base + [a for d, _, v in DIFFUSERS_SPELLINGS for a in (d, v)]))
    ours = script.config_from_args(script.parse_args(base + [a for _, o, v in DIFFUSERS_SPELLINGS for a in (o, v)]))
    assert theirs == ours
    assert (ours.data_dir, ours.image_size, ours.train_batch_size, ours.max_steps, ours.checkpoint_every) == \
        ("d", 32, 8, 7, 3)
    assert (ours.warmup_steps, ours.resume, ours.num_workers, ours.gradient_accumulation_steps, ours.lr_scheduler) == \
        (5, "latest", 1, 2, "cosine")


def test_help_lists_each_flag_once_and_no_alias(load_script, capsys):
    with pytest.raises(SystemExit):
        load_script("train").parse_args(["--help"])
    text = capsys.readouterr().out
    flags = re.findall(r"^  (--[a-z0-9_-]+)", text.split("\noptions:\n", 1)[1], re.M)
    assert len(flags) == len(set(flags)) and {"--gradient-accumulation-steps", "--lr-scheduler", "--ema-warmup",
                                              "--train-batch-size"} <= set(flags)
    usage = text.split("\n\n", 1)[0]
    assert not {d for d, _, _ in DIFFUSERS_SPELLINGS} & set(flags) and "_" not in "".join(flags)
    assert not any(re.search(rf"\[{d}\b", usage) for d, _, _ in DIFFUSERS_SPELLINGS)


def test_train_batch_size_is_per_process_and_per_pass(tmp_path, data):
    cfg = config(tmp_path, data, global_batch_size=None, train_batch_size=2, gradient_accumulation_steps=2)
    launch = cfg.for_launch(3, "no", 2, "none")
    assert (launch.global_batch_size, launch.train_batch_size, launch.gradient_accumulation_steps) == (12, 2, 2)
    launch = config(tmp_path, data, global_batch_size=None).for_launch(4, "no", 1, "none")
    assert (launch.global_batch_size, launch.train_batch_size) == (256, 64)  # DiT's default global batch
    assert config(tmp_path, data, global_batch_size=8, train_batch_size=2).for_launch(2, "no", 2, "none") \
        .global_batch_size == 8  # both given and agreeing


def test_accumulation_has_one_source_the_flag_or_accelerates_variable(tmp_path, data, load_script, monkeypatch,
                                                                      capsys):
    """accelerate launch hands its --gradient_accumulation_steps to a script only as
    ACCELERATE_GRADIENT_ACCUMULATION_STEPS (for DeepSpeed), which its Accelerator prefers to the
    script's value. Without the option the variable is the accumulation, said and recorded; an
    option that disagrees is refused by the run and by its dry run alike, and so is a value that
    is not a count."""
    run = tmp_path / "run"
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
    for call in (preflight, train):
        refused(tmp_path, InvalidInput, lambda: call(config(tmp_path, data, gradient_accumulation_steps=4)),
                "gradient_accumulation_steps", mentions=("gradient_accumulation_steps 4",
                                                         "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=2"))
    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(run, data, "--dry-run")) == 0
    assert '"gradient_accumulation_steps": 2' in capsys.readouterr().out
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 1)) == 0
    assert "x 2 accumulation steps (accumulation: ACCELERATE_GRADIENT_ACCUMULATION_STEPS)" in capsys.readouterr().out
    assert json.loads((run / "train_config.json").read_text())["gradient_accumulation_steps"] == 2
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
    refused(tmp_path, InvalidInput, lambda: preflight(config(tmp_path, data, output_dir=str(tmp_path / "other"))),
            "gradient_accumulation_steps", mentions=("ACCELERATE_GRADIENT_ACCUMULATION_STEPS='auto'",))


def _capture_grads(monkeypatch):
    """Every AdamW step's gradients, in parameter order, before the step."""
    grads, real_step = [], torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        grads.append([p.grad.clone() for group in self.param_groups for p in group["params"] if p.grad is not None])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return grads


def test_accumulated_step_equals_one_big_batch(tmp_path, data, monkeypatch):
    """2 passes of 2 images with accumulation 2 give the gradient of one pass of 4 (one timestep
    for all, and noise a function of the image, so that both see the same draws)."""
    diffusion_cls = type(create_diffusion())
    monkeypatch.setattr(diffusion_cls, "sample_timesteps", lambda self, n, device=None, generator=None:
                        torch.full((n,), 500, device=device))
    monkeypatch.setattr(torch, "randn_like", lambda x, **kw: torch.sin(7.0 * x + 1.0))
    grads = _capture_grads(monkeypatch)
    kw = dict(preset="DiT-Tiny", max_steps=1, checkpoint_every=1, class_dropout=0.0, random_flip=False,
              learning_rate=1e-3)
    big = train(config(tmp_path, data, output_dir=str(tmp_path / "big"), global_batch_size=4, **kw))
    assert big.is_dir()
    one = grads.pop()
    train(config(tmp_path, data, output_dir=str(tmp_path / "acc"), global_batch_size=4, gradient_accumulation_steps=2,
                 **kw))
    two = grads.pop()
    assert not grads and len(one) == len(two)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(one, two))
    record = json.loads((tmp_path / "acc" / "train_config.json").read_text())
    assert (record["global_batch_size"], record["train_batch_size"], record["gradient_accumulation_steps"]) == (4, 2, 2)


@pytest.mark.slow
def test_accumulated_run_with_ema_warmup_and_cosine_resumes_exactly(tmp_path, data, monkeypatch):
    """4 steps of 2 accumulated passes each == 2 steps, a crash in step 3, --resume latest to 4:
    the same weights, EMA (its warm-up is a function of the step), LR schedule and data position."""
    from diffusers.optimization import get_scheduler

    kw = dict(max_steps=4, checkpoint_every=2, log_every=1, global_batch_size=4, gradient_accumulation_steps=2,
              ema_warmup=True, ema_decay=0.999, lr_scheduler="cosine", warmup_steps=1, learning_rate=1e-3)
    train(config(tmp_path, data, output_dir=str(tmp_path / "one"), **kw))
    real_update, calls = training.update_ema, {"n": 0}

    def crashing_update(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Crash
        return real_update(*args, **kwargs)

    monkeypatch.setattr(trainer, "update_ema", crashing_update)
    with pytest.raises(_Crash):
        train(config(tmp_path, data, output_dir=str(tmp_path / "two"), **kw))
    monkeypatch.setattr(trainer, "update_ema", real_update)
    train(config(tmp_path, data, output_dir=str(tmp_path / "two"), resume="latest", **kw))
    for name in ("model.safetensors", "ema.safetensors", "optimizer.safetensors", "scheduler.json",
                 "train_state.json", "random_states_0.safetensors"):
        assert ((tmp_path / "one" / "checkpoints" / "step-0000004" / name).read_bytes()
                == (tmp_path / "two" / "checkpoints" / "step-0000004" / name).read_bytes()), name
    assert json.loads((tmp_path / "one" / "checkpoints" / "step-0000004" / "train_state.json").read_text()) \
        ["sampler"]["position"] == 16  # 4 steps x 2 passes x 2 images
    # the LR of each step is diffusers' cosine schedule with one warm-up step, in both runs
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    reference = get_scheduler("cosine", sgd, num_warmup_steps=1, num_training_steps=4)
    expected = []
    for _ in range(4):
        sgd.step()
        reference.step()
        expected.append(reference.get_last_lr()[0])
    for run in ("one", "two"):
        lrs = [json.loads(line)["lr"] for line in (tmp_path / run / "train_log.jsonl").read_text().splitlines()]
        assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15), run


def test_a_resume_with_other_settings_applies_them_says_so_and_keeps_every_segment(tmp_path, data, load_script,
                                                                                    capsys):
    """A changed --learning-rate or --weight-decay takes effect (the checkpoint's optimiser state
    would restore the old ones), the run says what changed, and train_config.json keeps both
    segments' settings; the current ones stay at its top level for the run's readers."""
    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 2)) == 0
    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(run, data, "--resume", "latest", "--learning-rate", "5e-5",
                                               "--weight-decay", "0.01", "--global-batch-size", "2",
                                               "--ema-warmup")) == 0
    out = capsys.readouterr().out
    for change in ("learning_rate 0.0001 -> 5e-05", "weight_decay 0.0 -> 0.01", "max_steps 2 -> 4",
                   "global_batch_size 4 -> 2", "ema_warmup False -> True"):
        assert change in out, out
    assert "resume None" not in out
    lrs = [json.loads(line)["lr"] for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert lrs == [1e-4, 1e-4, 5e-5, 5e-5]
    groups = training_checkpoints._load_tree(find_latest_checkpoint(run) / "optimizer.safetensors")["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01]
    record = json.loads((run / "train_config.json").read_text())
    assert [(s["start_step"], s["learning_rate"], s["global_batch_size"]) for s in record["segments"]] == [
        (0, 1e-4, 4), (2, 5e-5, 2)]
    assert (record["learning_rate"], record["max_steps"]) == (5e-5, 4)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one state per process; a test that needs another precision starts and
    ends with a fresh one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.slow
def test_mixed_precision_left_out_is_accelerates(tmp_path, data, load_script, monkeypatch, capsys,
                                                 fresh_accelerate_state):
    """Without --mixed-precision, accelerate launch's choice (ACCELERATE_MIXED_PRECISION) is used,
    said and recorded."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(tmp_path / "run", data, "--max-steps", 1)) == 0
    out = capsys.readouterr().out
    assert re.search(r"Mixed precision: bf16 \(accelerate's ACCELERATE_MIXED_PRECISION", out), out
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["mixed_precision"] == "bf16"


def test_mixed_precision_flag_wins_over_accelerate(tmp_path, data, load_script, monkeypatch, capsys,
                                                   fresh_accelerate_state):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(tmp_path / "run", data, "--max-steps", 1, "--mixed_precision", "no")) == 0
    assert "Mixed precision: no (mixed_precision)" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["mixed_precision"] == "no"


@pytest.mark.parametrize("tracker, install", [("tensorboard", "pip install tensorboard"),
                                              ("wandb", "pip install wandb")])
def test_a_tracker_asked_for_but_not_installed_is_refused(tmp_path, data, monkeypatch, tracker, install):
    import moh_dit.training.tracking as tracking

    monkeypatch.setattr(tracking, "available_trackers", lambda: set())
    refused(tmp_path, InvalidInput, lambda: train(config(tmp_path, data, report_to=tracker)), "report_to",
            mentions=(f"{tracker} is not installed", install))


def test_default_tracker_is_tensorboard_when_installed_else_none(tmp_path, data, load_script, monkeypatch, capsys):
    """A run without --report-to on an install without TensorBoard trains, and says so; with
    it installed, TensorBoard is the default (as in diffusers' scripts)."""
    import moh_dit.training.tracking as tracking

    monkeypatch.setattr(tracking, "available_trackers", lambda: {"tensorboard"})
    assert tracking.resolve_report_to(None)[0] == "tensorboard" and tracking.resolve_report_to("none")[0] == "none"
    monkeypatch.setattr(tracking, "available_trackers", lambda: set())
    argv = cli_args(tmp_path / "run", data, "--max-steps", 1)
    i = argv.index("--report-to")
    del argv[i:i + 2]
    capsys.readouterr()
    assert run_cli_train(load_script, argv) == 0
    captured = capsys.readouterr()
    assert re.search(r"Tracker: none \(TensorBoard is not installed \(pip install tensorboard", captured.out), \
        captured.out
    assert f"Done. EMA model: {tmp_path / 'run' / 'final'}" in captured.out
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["report_to"] == "none"
    # the run's EMA (0.9 over 1 step) is still mostly the initial weights: said at the start
    assert re.search(r"warning: ema_decay 0.9 over 1 steps.*90% the initial weights.*ema_warmup", captured.err)


class _RecordingTracker(GeneralTracker):
    """An accelerate tracker that keeps what it is given."""

    name, requires_logging_directory = "recording", False

    def __init__(self):
        super().__init__()
        self.config, self.scalars, self.images = None, [], []

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values):
        self.config = values

    def log(self, values, step=None, **kwargs):
        self.scalars.append((step, values))

    def log_images(self, values, step=None, **kwargs):
        self.images.append((step, {k: v.clone() for k, v in values.items()}))


def test_sample_grids_and_scalars_go_to_the_tracker(tmp_path, data, monkeypatch):
    import moh_dit.training.tracking as tracking

    recording = _RecordingTracker()
    monkeypatch.setattr(tracking, "available_trackers", lambda: {"tensorboard"})
    monkeypatch.setattr(trainer, "log_with", lambda report_to: [recording])
    train(config(tmp_path, data, report_to="tensorboard", max_steps=2, log_every=1, sample_every=2, sample_steps=2))
    assert recording.config["max_steps"] == 2 and recording.config["report_to"] == "tensorboard"
    assert [step for step, _ in recording.scalars] == [1, 2] and "loss" in recording.scalars[0][1]
    # the grid, then (a MoH model) its head-usage figure, at the sample step
    assert [(step, list(images)) for step, images in recording.images] == [(2, ["samples"]), (2, ["head_usage"])]
    step, images = recording.images[0]
    grid = images["samples"]
    assert step == 2 and grid.shape[:2] == (1, 3) and 0 <= grid.min() and grid.max() <= 1
    # the grid of the PNG: the same images, classes 0-2 in a row, four seeds
    png = np.asarray(Image.open(tmp_path / "run" / "samples" / "step-0000002.png")).astype(np.float32) / 255
    assert png.shape[:2] == tuple(grid.shape[2:]) and np.abs(png - grid[0].permute(1, 2, 0).numpy()).max() < 1 / 255 + 1e-6


def test_ema_warmup_follows_diffusers_ema_model_and_survives_the_short_run(tmp_path, data, capsys):
    """Decay of step n is diffusers' EMAModel(use_ema_warmup=True).get_decay(n); after the
    first step the EMA is that step's weights, and the short run gets no stale-EMA warning."""
    from diffusers.training_utils import EMAModel

    from moh_dit.training.schedules import ema_decay_at

    for inv_gamma, power in ((1.0, 2 / 3), (10.0, 0.75)):
        ref = EMAModel(torch.nn.Linear(1, 1).parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=inv_gamma,
                       power=power)
        assert [ema_decay_at(n, 0.9999, True, inv_gamma, power) for n in range(1, 2000, 37)] == \
            pytest.approx([ref.get_decay(n) for n in range(1, 2000, 37)], rel=1e-12)
    assert ema_decay_at(5, 0.9999) == 0.9999  # no warm-up: DiT's constant decay
    capsys.readouterr()
    train(config(tmp_path, data, max_steps=1, checkpoint_every=1, ema_decay=0.9999, ema_warmup=True))
    assert "warning" not in capsys.readouterr().err
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000001"
    model, ema = _weights(ckpt), _weights(ckpt, "ema.safetensors")
    assert all(torch.equal(model[k], ema[k]) for k in model)


def test_stale_ema_warning_only_where_the_ema_would_keep_the_initial_weights(tmp_path, data, load_script, capsys):
    def warning(**kw):
        return config(tmp_path, data, **kw).ema_warning()

    assert warning(max_steps=400_000, ema_decay=0.9999) is None  # the paper's recipe
    assert warning(max_steps=20, ema_decay=0.9999, ema_warmup=True) is None
    assert warning(max_steps=23_100, ema_decay=0.9999) is None  # 0.9999 ** 23100 = 0.099
    assert "ema_warmup" in warning(max_steps=23_000, ema_decay=0.9999)  # 0.9999 ** 23000 = 0.100 and a bit
    assert "14% the initial weights" in warning(max_steps=19_800, ema_decay=0.9999)
    capsys.readouterr()
    argv = cli_args(tmp_path / "run", data, "--max-steps", 20, "--ema-decay", 0.9999, "--dry-run")
    assert run_cli_train(load_script, argv) == 0
    assert re.search(r"warning: ema_decay 0.9999 over 20 steps.*100% the initial weights.*ema_warmup",
                     capsys.readouterr().err)


def test_checkpoints_and_final_get_the_permissions_the_umask_gives(tmp_path, data):
    """Checkpoint folders and final/ are published like any folder the user makes (0755 / 0644
    under umask 022), not with the temporary folder's owner-only modes."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        final = train(config(tmp_path, data, max_steps=2, checkpoint_every=2))
    finally:
        os.umask(old)
    for folder in (final, find_latest_checkpoint(tmp_path / "run")):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder
        for f in folder.iterdir():
            if f.is_file():
                assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


# --------------------------------------------------------------------------------------
# No command overwrites what it did not write: links, inputs, latent caches, damage, faults
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [train, preflight])
def test_a_link_in_place_of_the_lock_is_refused_and_its_target_kept(tmp_path, data, call):
    """The run writes who holds the folder into its lock, .OUT.lock beside it: through a link it
    would overwrite (or create) whatever the link points to."""
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("user data\n")
    lock_path(run).symlink_to(victim)
    refused(tmp_path, FileExistsError, lambda: call(config(tmp_path, data)), mentions=(lock_path(run), "link"))
    assert victim.read_text() == "user data\n"


@pytest.mark.parametrize("extra", [[], ["--dry-run"]])
@pytest.mark.parametrize("where", ["lock", "inside"])
def test_a_dangling_link_creates_nothing(tmp_path, data, load_script, capsys, extra, where):
    """A link in place of the lock, or anywhere inside the run folder (here where older versions
    kept their lock), is refused naming it; nothing is created, its target included."""
    run = tmp_path / "run"
    run.mkdir()
    link = lock_path(run) if where == "lock" else run / ".lock"
    link.symlink_to(tmp_path / "missing.txt")
    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(run, data, *extra)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(link) in err and "symbolic link" in err, err
    assert not (tmp_path / "missing.txt").exists() and sorted(p.name for p in run.iterdir()) == (
        [".lock"] if where == "inside" else [])


@pytest.fixture
def own_data(tmp_path):
    """Data under tmp_path, so that `refuses` sees anything a refused run would write into it."""
    return make_image_folder(tmp_path / "data", per_class=2)


@pytest.mark.parametrize("out, call, kw, where", [
    ("data/run", train, dict(sample_every=2), "lies inside"),
    ("data/blue", train, {}, "lies inside"),
    ("data", train, {}, "is"),
    (".", train, {}, "contains"),
    ("alias/run", train, {}, "lies inside"),  # the same folder through a link
    ("data/run", preflight, {}, "lies inside"),
])
def test_a_run_folder_inside_the_data_is_refused(tmp_path, own_data, out, call, kw, where):
    """Sample grids, checkpoints/ and final/ written there would become images and classes of the data."""
    (tmp_path / "alias").symlink_to(own_data, target_is_directory=True)
    refused(tmp_path, InvalidInput, lambda: call(config(tmp_path, own_data, output_dir=str(tmp_path / out), **kw)),
            "output_dir", "data_dir", mentions=(f"{tmp_path / out} {where} data_dir",))


def test_a_run_folder_inside_the_latent_cache_or_the_init_weights_is_refused(tmp_path, data, upcycled):
    cache = tmp_path / "latents"
    cache.mkdir()
    refused(tmp_path, InvalidInput, lambda: train(config(tmp_path, None, data_dir=None, latents_dir=str(cache),
                                                         output_dir=str(cache / "run"))),
            "output_dir", "latents_dir", mentions=("lies inside latents_dir",))
    refused(upcycled, InvalidInput, lambda: train(config(tmp_path, data, output_dir=str(upcycled / "run"),
                                                         preset="MoH-DiT-Tiny-up75", init_from=str(upcycled))),
            "output_dir", "init_from", mentions=("lies inside init_from",))


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory, data, tiny_vae):
    """A 16 px latent cache of ``data`` made with a tiny VAE (8 x 8 x 4 latents)."""
    from moh_dit.data.latents import extract_latents

    root = tmp_path_factory.mktemp("cache")
    tiny_vae().save_pretrained(root / "vae")
    return extract_latents(data, root / "vae", root / "latents", 16, batch_size=6, num_workers=0, device="cpu",
                           progress=False)


def latent_args(out, cache, *extra):
    argv = cli_args(out, cache, *extra)
    i = argv.index("--data-dir")
    argv[i:i + 2] = ["--latents-dir", str(cache)]
    for flag in ("--vae", "--image-size"):  # the cache's unless given
        i = argv.index(flag)
        del argv[i:i + 2]
    return argv


@pytest.mark.slow
def test_a_latent_run_records_and_samples_with_the_caches_size_and_vae(tmp_path, small_cache, load_script):
    run = tmp_path / "run"
    vae = small_cache.parent / "vae"
    assert run_cli_train(load_script, latent_args(run, small_cache, "--max-steps", 2, "--sample-every", 2,
                                                  "--sample-steps", 2)) == 0
    record = json.loads((run / "train_config.json").read_text())
    assert record["image_size"] == 16 and record["vae"] == str(vae) and record["latent_shape"] == [4, 8, 8]
    grid = Image.open(run / "samples" / "step-0000002.png")
    # decoded images (RGB, 16 px: 3 classes x 4 rows with make_grid's 2 px padding), not raw latents (RGBA, 8 px)
    assert grid.mode == "RGB" and grid.size == (3 * 18 + 2, 4 * 18 + 2)
    # the same flags given explicitly are accepted
    assert run_cli_train(load_script, latent_args(tmp_path / "explicit", small_cache, "--image-size", 16,
                                                  "--vae", vae, "--dry-run")) == 0


@pytest.mark.slow
def test_final_is_a_pipeline_folder_with_the_runs_vae_and_a_run_folder_stands_for_it(tmp_path, small_cache,
                                                                                       load_script):
    """final/ is diffusers' pipeline layout: the EMA model as transformer/, the paper's DDPM, the
    cache's VAE (saved without --sample-every) and the class names. MoHDiTPipeline and load_pipeline
    load it, load_pipeline and sample take the run folder, nobody passes the VAE again, and
    --init-from takes it."""
    from moh_dit import MoHDiTPipeline, load_pipeline

    run = tmp_path / "run"
    assert run_cli_train(load_script, latent_args(run, small_cache, "--max-steps", 1, "--checkpoint-every", 1)) == 0
    final = run / "final"
    pipe = MoHDiTPipeline.from_pretrained(final)
    assert pipe.vae is not None and pipe.vae.config.block_out_channels == [8, 8]
    assert pipe.scheduler.config.variance_type == "learned_range" and not pipe.scheduler.config.clip_sample
    assert pipe.id2label == {0: "blue", 1: "green", 2: "red"}
    ema = load_file(find_latest_checkpoint(run) / "ema.safetensors")
    exported = load_file(final / "transformer" / "diffusion_pytorch_model.safetensors")
    assert set(ema) == set(exported) and all(torch.equal(ema[k], exported[k]) for k in ema)
    assert load_pipeline(run).vae is not None
    MoHDiTTransformer2DModel.from_pretrained(final, subfolder="transformer")
    with pytest.raises(OSError, match=r'final is a pipeline folder.*subfolder="transformer"'):
        MoHDiTTransformer2DModel.from_pretrained(final)
    assert load_script("sample").cli(["--model", str(run), "--output-dir", str(tmp_path / "samples"), "--num-samples",
                                      "2", "--num-inference-steps", "2", "--no-npz", "--quiet"]) == 0
    assert Image.open(tmp_path / "samples" / "samples" / "000000.png").size == (16, 16)  # decoded by the run's VAE
    # and a new run starts from it (its transformer)
    assert run_cli_train(load_script, latent_args(tmp_path / "next", small_cache, "--max-steps", 1, "--init-from",
                                                  final)) == 0


def latent_config(tmp_path, cache, **kw):
    return config(tmp_path, None, **{"data_dir": None, "latents_dir": str(cache), "vae": None, "image_size": None,
                                     **kw})


@pytest.mark.parametrize("kw, call, parameter, mentions", [
    (dict(image_size=64), train, "image_size", ("image_size 64", "16 px")),
    (dict(vae="none"), train, "vae", ("pixels", "/vae")),
    (dict(vae="stabilityai/sd-vae-ft-ema"), train, "vae", ("stabilityai/sd-vae-ft-ema", "/vae")),
    (dict(image_size=64), preflight, "image_size", ("image_size 64", "16 px")),
])
def test_options_that_contradict_the_latent_cache_are_refused(tmp_path, small_cache, kw, call, parameter, mentions):
    refused(tmp_path, InvalidInput, lambda: call(latent_config(tmp_path, small_cache, **kw)), parameter, "latents_dir",
            mentions=(small_cache, *mentions))


def test_an_older_cache_without_its_image_size_needs_the_option(tmp_path, small_cache, load_script):
    import shutil

    cache = tmp_path / "old"
    shutil.copytree(small_cache, cache)
    index = json.loads((cache / "index.json").read_text())
    del index["image_size"]
    (cache / "index.json").write_text(json.dumps(index))
    refused(tmp_path, InvalidInput, lambda: preflight(latent_config(tmp_path, cache)), "image_size", "latents_dir",
            mentions=(cache,))
    assert run_cli_train(load_script, latent_args(tmp_path / "run", cache, "--image-size", 16, "--dry-run")) == 0


@pytest.mark.slow
def test_a_checkpoint_without_its_marker_is_named_as_damage(tmp_path, data, load_script, capsys):
    """A finished checkpoint is renamed into place only once its marker is written, so a
    step-N folder without checkpoint.json was damaged; a hidden .step-N.tmp is a save in progress."""
    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data, "--checkpoints-total-limit", 0)) == 0
    (run / "checkpoints" / "step-0000004" / "checkpoint.json").unlink()
    (run / "checkpoints" / ".step-0000006.tmp").mkdir()
    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 5, "--resume", "latest", "--dry-run")) == 0
    err = capsys.readouterr().err
    assert re.search(r"warning: .*step-0000004/checkpoint\.json is missing.*step-0000002", err), err
    assert ".step-0000006.tmp" not in err
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 5, "--resume", "latest")) == 0
    assert "step-0000004 is damaged" in capsys.readouterr().err
    assert log_steps(run) == [1, 2, 3, 4, 5]


def test_a_folder_held_by_a_live_run_is_refused_by_the_dry_run_too(tmp_path, data, load_script):
    import os

    from moh_dit.utils.io import lock_file, write_lock_info

    run = tmp_path / "run"
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 2)) == 0
    fd = lock_file(lock_path(run))  # a live run's hold (another open file: flock tells them apart)
    try:
        write_lock_info(fd, {"pid": 4242, "host": "gpu7", "started": "today"})
        refused(tmp_path, FolderInUse, lambda: preflight(config(tmp_path, data, resume="latest")), "output_dir",
                mentions=(run, "pid 4242", "gpu7"))
    finally:
        os.close(fd)
    assert run_cli_train(load_script, cli_args(run, data, "--max-steps", 3, "--resume", "latest", "--dry-run")) == 0


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_anything_is_written(tmp_path, data, monkeypatch):
    """global_batch_size=1000000000 used to fail with a MemoryError after the run record was
    written; here the machine is made small (1 MiB) instead, so that the test stays cheap."""
    import moh_dit.utils.resources as resources

    monkeypatch.setattr(resources, "available_memory", lambda: 2**20)
    for call in (train, preflight):
        refused(tmp_path, InvalidInput, lambda: call(config(tmp_path, data, global_batch_size=1000, max_steps=1,
                                                            checkpoint_every=1)),
                "global_batch_size", mentions=("global_batch_size 1000", "3x16x16", "1.0 MiB"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the step's activations are the device's")
def test_a_batch_whose_training_step_cannot_fit_is_refused(tmp_path, data, monkeypatch):
    """global_batch_size=100000 of 16 px images: the inputs take about 0.6 GiB, but the step's
    activations about 150 GiB (the kernel killed such a run at 21 GB resident, with no
    message); on a 4 GiB machine it is refused before anything is written."""
    import moh_dit.utils.resources as resources

    monkeypatch.setattr(resources, "available_memory", lambda: 4 * 2**30)
    for call in (train, preflight):
        refused(tmp_path, InvalidInput, lambda: call(config(tmp_path, data, global_batch_size=100000, max_steps=1,
                                                            checkpoint_every=1)),
                "global_batch_size", mentions=("global_batch_size 100000", "MoH-DiT-Tiny training", "4.0 GiB"))


def test_a_run_that_stopped_before_its_first_checkpoint_says_how_to_continue(tmp_path, data, monkeypatch,
                                                                            load_script):
    run = tmp_path / "run"

    def crash(*args, **kwargs):
        raise _Crash

    monkeypatch.setattr(trainer, "update_ema", crash)
    with pytest.raises(_Crash):
        train(config(tmp_path, data))
    monkeypatch.undo()
    refused(tmp_path, OutputExists, lambda: train(config(tmp_path, data)), "output_dir", "resume",
            mentions=(run, "train_config.json", "before its first checkpoint", "from step 0"))
    assert run_cli_train(load_script, cli_args(run, data, "--resume", "latest")) == 0


def _no_space(kind: str, filename):
    import errno

    from safetensors import SafetensorError

    if kind == "safetensors":  # safetensors' own error: not an OSError, no path
        return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    return OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("kind", ["safetensors", "oserror"])
def test_a_full_disk_during_a_checkpoint_is_one_line_naming_it_and_a_rerun_resumes(tmp_path, data, load_script,
                                                                                   monkeypatch, capsys, kind):
    run = tmp_path / "run"
    real = training_checkpoints.save_file

    def full_at_step_4(tensors, filename, metadata=None):
        if "step-0000004" in str(filename):
            Path(filename).write_bytes(b"half")
            raise _no_space(kind, filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(training_checkpoints, "save_file", full_at_step_4)
    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(run, data, "--quiet", "--ema-decay", 0.5)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err  # --quiet: the error alone
    # the file being written, the checkpoint not saved, and the flag that continues the run
    assert re.search(r"^error: No space left on device while writing .*/checkpoints/\.step-0000004\.tmp/"
                     r"\S+\.safetensors; checkpoint .*/checkpoints/step-0000004 was not saved .*--resume='latest'$",
                     err.strip()), err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000002"]  # nothing half-written
    training.verify_checkpoint(run / "checkpoints" / "step-0000002")
    monkeypatch.undo()
    assert run_cli_train(load_script, cli_args(run, data, "--resume", "latest")) == 0
    assert log_steps(run) == [1, 2, 3, 4]


def test_the_run_folder_and_final_carry_the_marker_of_train(tmp_path, data):
    from moh_dit.utils.output_folders import OUTPUT_MARKER

    final = train(config(tmp_path, data, max_steps=2))
    for folder in (tmp_path / "run", final):
        assert json.loads((folder / OUTPUT_MARKER).read_text())["written_by"] == "moh-dit train"


def test_a_failure_on_the_main_process_reaches_the_others_with_its_kind_errno_and_path(monkeypatch):
    """What another process of a launch raises when the main process fails (no real launch:
    the broadcast is played back)."""
    import errno
    import types

    import accelerate.utils

    from moh_dit.utils.io import LinkRefusedError

    sent = {}

    def broadcast(payload, from_process=0):
        if "payload" in sent:
            payload[:] = sent["payload"]
        else:
            sent["payload"] = list(payload)

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)
    for error, kind in ((OSError(errno.ENOSPC, "No space left on device while writing /x", "/x"), OSError),
                        (LinkRefusedError("/r/.lock is a symbolic link"), FileExistsError),
                        (FolderInUse("output_dir /x/lock is in use", parameters="output_dir"), FolderInUse),
                        (KeyError("bug"), RuntimeError)):
        sent.clear()

        def fail():
            raise error

        with pytest.raises(type(error)):
            training_checkpoints.on_main(types.SimpleNamespace(is_main_process=True, num_processes=2), fail)
        with pytest.raises(kind) as raised:
            training_checkpoints.on_main(types.SimpleNamespace(is_main_process=False, num_processes=2), fail)
        if kind is OSError:
            assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, "/x")
        if kind is FolderInUse:  # named by its parameter, for the command to show its flag on every process
            assert raised.value.parameters == ("output_dir",)
        assert "/x" in str(raised.value) or "lock" in str(raised.value) or "KeyError" in str(raised.value)


def test_a_full_disk_while_exporting_final_is_one_line_and_a_rerun_exports_it(tmp_path, data, load_script,
                                                                              monkeypatch, capsys):
    import errno

    run = tmp_path / "run"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "write_class_index", full)
    capsys.readouterr()
    assert run_cli_train(load_script, cli_args(run, data, "--quiet", "--ema-decay", 0.5)) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert re.search(r"^error: No space left on device while writing .*run/final; .*run/final was not exported .*"
                     r"--resume='latest', which exports it again$", err), err
    assert sorted(p.name for p in run.iterdir() if "final" in p.name) == []  # no half-written export left
    monkeypatch.undo()
    assert run_cli_train(load_script, cli_args(run, data, "--resume", "latest")) == 0
    assert (run / "final" / "transformer" / "config.json").is_file()
