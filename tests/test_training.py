"""Training on tiny generated data: the run folder, pixel / VAE / latent-cache spaces, exact resume
after a crash, accumulation, the EMA, the finite watch without host reads, and the command line."""

import json
import os
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import moh_dit.training.trainer as trainer
from moh_dit import MoHDiTPipeline, MoHDiTTransformer2DModel
from moh_dit.commands import run
from moh_dit.diffusion import create_diffusion
from moh_dit.training import Checkpoint, TrainConfig, find_latest_checkpoint, train

pytestmark = pytest.mark.usefixtures("one_thread")


def make_image_folder(root: Path, classes=("blue", "red", "green"), per_class=6, size=20) -> Path:
    rng = np.random.default_rng(0)
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


def cli(*argv):
    """``moh-dit train ARGV`` (with --debug: an error is raised as it is)."""
    assert run("train", [str(a) for a in argv] + ["--debug"]) == 0


def cli_args(run, data, *extra):
    return ["--data-dir", data, "--vae", "none", "--image-size", 16, "--output-dir", run, "--max-steps", 2,
            "--global-batch-size", 4, "--checkpoint-every", 2, "--num-workers", 0, "--report-to", "none",
            "--log-every", 1, "--ema-decay", 0.9, *extra]


def log_steps(run: Path, name="train_log.jsonl") -> list[int]:
    return [json.loads(line)["step"] for line in (run / name).read_text().splitlines()]


def same_files(a: Path, b: Path, *names):
    for name in names:
        x, y = load_file(a / name), load_file(b / name)
        assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x), name


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data") / "images")


def test_a_run_writes_its_folder(tmp_path, data):
    old = os.umask(0o022)
    try:
        final = train(config(tmp_path, data, sample_every=4, sample_steps=3))
    finally:
        os.umask(old)
    run = tmp_path / "run"
    assert final == run / "final"
    pipe = MoHDiTPipeline.from_pretrained(final)
    model = pipe.transformer
    assert model.config.class_names == ["blue", "green", "red"] and model.config.num_classes == 3
    assert model.config.in_channels == 3 and model.config.sample_size == 16 and list(final.glob("transformer/*.safet*"))
    record = json.loads((run / "train_config.json").read_text())
    assert record["preset"] == "MoH-DiT-Tiny" and record["model_config"]["num_classes"] == 3
    assert (record["global_batch_size"], record["train_batch_size"], record["num_processes"]) == (4, 4, 1)
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-0000002", "step-0000004"]
    logs = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logs] == [2, 4] and logs[0]["lb"] > 0 and 0 < logs[0]["mfu"] < 1
    assert all(np.isfinite(e[k]) for e in logs for k in ("loss", "mse", "vb", "lb", "grad_norm", "lr"))
    usage = [json.loads(line) for line in (run / "head_usage.jsonl").read_text().splitlines()]
    assert [e["step"] for e in usage] == [2, 4] and len(usage[0]["usage"]) == model.config.num_layers
    assert Image.open(run / "samples" / "step-0000004.png").size[0] > 16
    # safetensors and JSON only, with the permissions the umask gives
    files = [p for p in run.rglob("*") if p.is_file()]
    assert {p.suffix for p in run.glob("checkpoints/*/*")} == {".safetensors", ".json"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in files)


@pytest.mark.slow
def test_a_vae_run_encodes_on_the_fly(tmp_path, data, tiny_vae):
    tiny_vae().save_pretrained(tmp_path / "vae")
    final = train(config(tmp_path, data, vae=str(tmp_path / "vae"), max_steps=2))
    pipe = MoHDiTPipeline.from_pretrained(final)
    assert pipe.transformer.config.in_channels == 4 and pipe.transformer.config.sample_size == 8 and pipe.vae


@pytest.mark.slow
def test_a_latent_cache_run_takes_the_caches_size_and_vae(tmp_path, data, tiny_vae):
    from moh_dit.data.latents import extract_latents

    vae_dir = tmp_path / "vae"
    tiny_vae().save_pretrained(vae_dir)
    extract_latents(data, vae_dir, tmp_path / "latents", 16, batch_size=4, num_workers=0, progress=False)
    final = train(config(tmp_path, None, data_dir=None, latents_dir=str(tmp_path / "latents"), max_steps=2,
                         vae=None, image_size=None))
    pipe = MoHDiTPipeline.from_pretrained(final)
    assert pipe.transformer.config.in_channels == 4 and pipe.vae is not None  # final/ decodes with the cache's VAE
    record = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert record["image_size"] == 16 and record["vae"] == str(vae_dir.absolute())
    with pytest.raises(ValueError, match="image_size 32"):
        train(config(tmp_path, None, data_dir=None, latents_dir=str(tmp_path / "latents"), image_size=32,
                     output_dir=str(tmp_path / "other")))
    assert not (tmp_path / "other").exists()


def test_cache_and_on_the_fly_give_the_same_loss(tmp_path, data, tiny_vae):
    """The same image, flip and posterior mean give the same diffusion loss whichever path made the latent."""
    from moh_dit.data.datasets import ImageFolderDataset
    from moh_dit.data.latents import LatentDataset, extract_latents, load_vae

    vae_dir = tmp_path / "vae"
    tiny_vae().save_pretrained(vae_dir)
    extract_latents(data, vae_dir, tmp_path / "latents", 16, batch_size=4, num_workers=0, progress=False)
    cache, images, vae = LatentDataset(tmp_path / "latents", sample_posterior=False), ImageFolderDataset(data, 16), \
        load_vae(vae_dir)
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, in_channels=4, num_classes=3)
    torch.nn.init.normal_(model.proj_out_2.weight, std=0.1)
    diffusion = create_diffusion()
    keys = [(i, 1) for i in range(len(images))]
    x_cache = torch.stack([cache[k][0] for k in keys])
    with torch.no_grad():
        x_fly = vae.encode(torch.stack([images[k][0] for k in keys])).latent_dist.mean * vae.config.scaling_factor
        gen = torch.Generator().manual_seed(0)
        t, noise = torch.randint(0, 1000, (len(keys),), generator=gen), torch.randn(x_fly.shape, generator=gen)
        y = torch.tensor([images[k][1] for k in keys])
        losses = []
        for x in (x_cache, x_fly):
            x_t = diffusion.q_sample(x, t, noise)
            losses.append(diffusion.training_losses(model(x_t, t, y).sample, x, x_t, t, noise)["loss"])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)


class _Crash(Exception):
    pass


@pytest.mark.slow
def test_resume_is_exact_after_a_crash(tmp_path, data, monkeypatch):
    """6 steps in one run == 3 steps, a crash in step 5, then resume="latest" to step 6; the log
    holds every step once (the crashed run had logged step 4 after its last checkpoint)."""
    kw = dict(max_steps=6, checkpoint_every=3, log_every=1)
    train(config(tmp_path, data, output_dir=str(tmp_path / "one"), **kw))
    real_update, calls = trainer.update_ema, []

    def crashing_update(*args):
        calls.append(1)
        if len(calls) == 5:  # after step 5's optimiser update, before its EMA update
            raise _Crash
        return real_update(*args)

    monkeypatch.setattr(trainer, "update_ema", crashing_update)
    with pytest.raises(_Crash):
        train(config(tmp_path, data, output_dir=str(tmp_path / "two"), **kw))
    assert find_latest_checkpoint(tmp_path / "two").name == "step-0000003"
    assert log_steps(tmp_path / "two") == [1, 2, 3, 4]
    monkeypatch.setattr(trainer, "update_ema", real_update)
    torch.manual_seed(999)  # the restart's global random state must not matter
    train(config(tmp_path, data, output_dir=str(tmp_path / "two"), resume="latest", **kw))
    assert log_steps(tmp_path / "two") == log_steps(tmp_path / "two", "head_usage.jsonl") == [1, 2, 3, 4, 5, 6]
    one, two = tmp_path / "one", tmp_path / "two"
    same_files(one, two, "final/transformer/diffusion_pytorch_model.safetensors",
               "checkpoints/step-0000006/model.safetensors", "checkpoints/step-0000006/ema.safetensors")
    for name in ("optimizer.safetensors", "train_state.json", "random_states_0.safetensors"):
        assert (one / "checkpoints/step-0000006" / name).read_bytes() == \
            (two / "checkpoints/step-0000006" / name).read_bytes(), name
    assert [json.loads(a)["loss"] for a in (one / "train_log.jsonl").read_text().splitlines()] == \
        [json.loads(b)["loss"] for b in (two / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rotation_named_checkpoints_and_an_interrupted_save(tmp_path, data, monkeypatch):
    import moh_dit.training.checkpoint as checkpoint

    train(config(tmp_path, data, max_steps=3, checkpoint_every=1, checkpoints_total_limit=2))
    assert [p.name for p in sorted((tmp_path / "run" / "checkpoints").iterdir())] == ["step-0000002", "step-0000003"]
    checkpoints = Checkpoint(tmp_path / "run")
    assert checkpoints.find("checkpoint-3") == checkpoints.find("step-3") == tmp_path / "run/checkpoints/step-0000003"
    with pytest.raises(FileNotFoundError):
        checkpoints.find("checkpoint-1")

    def broken_save(tensors, filename, metadata=None):  # a full disk in the middle of a save
        Path(filename).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", broken_save)
    with pytest.raises(OSError) as error:
        train(config(tmp_path, data, max_steps=4, checkpoint_every=1, resume="checkpoint-3"))
    assert error.value.errno == 28 and error.value.filename == str(tmp_path / "run/checkpoints/step-0000004")
    assert find_latest_checkpoint(tmp_path / "run").name == "step-0000003"
    monkeypatch.undo()
    train(config(tmp_path, data, max_steps=4, checkpoint_every=1, checkpoints_total_limit=0, resume="latest"))
    assert [p.name for p in sorted((tmp_path / "run" / "checkpoints").iterdir())] == [
        "step-0000002", "step-0000003", "step-0000004"]  # 0: keep all; no scratch left
    assert log_steps(tmp_path / "run") == [2, 3, 4]  # step 3 ended the first run


def test_a_nan_between_checks_is_caught_before_anything_is_written_without_host_reads(tmp_path, data, monkeypatch):
    """The finite watch reads the loss only at log / sample / checkpoint steps (a host read waits
    for the GPU), yet names the first NaN step, before that step's log or checkpoint."""
    real_forward, calls = MoHDiTTransformer2DModel.forward, []

    def nan_from_step_3(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        if self.training:
            calls.append(1)
            if len(calls) >= 3:
                out.sample = out.sample * float("nan")
        return out

    reads, real_step = [], trainer.train_step

    def watched_step(*args, **kwargs):  # no tensor read on the host inside a step
        names = ("item", "tolist", "__bool__", "__float__")
        saved = {n: getattr(torch.Tensor, n) for n in names}

        def reader(name):
            def read(self, *a, **k):
                if "torch/optim" not in sys._getframe(1).f_code.co_filename:  # AdamW's CPU step counters
                    reads.append(name)
                return saved[name](self, *a, **k)
            return read

        for n in names:
            monkeypatch.setattr(torch.Tensor, n, reader(n))
        try:
            return real_step(*args, **kwargs)
        finally:
            for n in names:
                monkeypatch.setattr(torch.Tensor, n, saved[n])

    monkeypatch.setattr(MoHDiTTransformer2DModel, "forward", nan_from_step_3)
    monkeypatch.setattr(trainer, "train_step", watched_step)
    with pytest.raises(RuntimeError, match="step 3;.* none"):
        train(config(tmp_path, data, max_steps=8, checkpoint_every=4, log_every=4))
    assert reads == [] and len(calls) == 4
    assert find_latest_checkpoint(tmp_path / "run") is None and not (tmp_path / "run" / "train_log.jsonl").exists()


@pytest.mark.parametrize("decay", [0.9999, 0.9, 0.0])
def test_foreach_ema_is_bit_identical_to_the_per_parameter_loop(decay):
    import copy

    torch.manual_seed(0)
    model = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, in_channels=3, num_classes=3)
    ema_a, ema_b = copy.deepcopy(model).requires_grad_(False), copy.deepcopy(model).requires_grad_(False)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            for e, p in zip(ema_b.parameters(), model.parameters()):
                e.mul_(decay).add_(p, alpha=1 - decay)
        trainer.update_ema(ema_a, model, decay)
    assert all(torch.equal(a, b) for a, b in zip(ema_a.state_dict().values(), ema_b.state_dict().values()))


def test_ema_warmup_follows_diffusers_ema_model_and_the_warning_says_when_the_run_is_too_short(tmp_path, data):
    from diffusers.training_utils import EMAModel

    cfg = config(tmp_path, data, ema_decay=0.9999, ema_warmup=True)
    ema = EMAModel(torch.nn.Linear(1, 1).parameters(), decay=0.9999, use_ema_warmup=True)
    for step in range(1, 50):
        ema.optimization_step = step
        assert trainer.ema_decay_at(step, cfg) == pytest.approx(ema.get_decay(step), abs=1e-12)
    assert cfg.ema_warning() is None
    assert "0.9999" in config(tmp_path, data, ema_decay=0.9999, max_steps=1000).ema_warning()
    assert config(tmp_path, data, ema_decay=0.9999, max_steps=400_000).ema_warning() is None


def _capture_grads(monkeypatch):
    grads, real_step = [], torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        grads.append([p.grad.clone() for g in self.param_groups for p in g["params"] if p.grad is not None])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return grads


@pytest.mark.slow
def test_an_accumulated_step_equals_one_big_batch(tmp_path, data, monkeypatch):
    """2 passes of 2 images with accumulation 2 give the gradient of one pass of 4 (one timestep
    for all, and noise a function of the image, so both see the same draws)."""
    monkeypatch.setattr(type(create_diffusion()), "sample_timesteps",
                        lambda self, n, device=None, generator=None: torch.full((n,), 500, device=device))
    monkeypatch.setattr(torch, "randn_like", lambda x, **kw: torch.sin(7.0 * x + 1.0))
    grads = _capture_grads(monkeypatch)
    kw = dict(preset="DiT-Tiny", max_steps=1, checkpoint_every=1, class_dropout=0.0, random_flip=False)
    train(config(tmp_path, data, output_dir=str(tmp_path / "big"), **kw))
    train(config(tmp_path, data, output_dir=str(tmp_path / "acc"), gradient_accumulation_steps=2, **kw))
    one, two = grads
    assert len(one) == len(two) and all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(one, two))
    record = json.loads((tmp_path / "acc" / "train_config.json").read_text())
    assert (record["global_batch_size"], record["train_batch_size"], record["gradient_accumulation_steps"]) == (4, 2, 2)


@pytest.mark.slow
def test_an_accumulated_run_with_ema_warmup_and_cosine_resumes_exactly(tmp_path, data):
    kw = dict(gradient_accumulation_steps=2, ema_warmup=True, lr_scheduler="cosine", warmup_steps=1, log_every=1)
    train(config(tmp_path, data, output_dir=str(tmp_path / "one"), **kw))
    train(config(tmp_path, data, output_dir=str(tmp_path / "two"), max_steps=2, **kw))
    train(config(tmp_path, data, output_dir=str(tmp_path / "two"), resume="latest", **kw))
    same_files(tmp_path / "one", tmp_path / "two", *(f"checkpoints/step-0000004/{n}.safetensors"
                                                     for n in ("model", "ema", "optimizer")))
    assert json.loads((tmp_path / "one/checkpoints/step-0000004/train_state.json").read_text()) == \
        json.loads((tmp_path / "two/checkpoints/step-0000004/train_state.json").read_text())


def test_batch_splits_and_the_config_checks(tmp_path, data):
    cfg = config(tmp_path, data, global_batch_size=None, train_batch_size=2, gradient_accumulation_steps=2)
    launch = cfg.resolved(3, 2)
    assert (launch.global_batch_size, launch.train_batch_size, launch.gradient_accumulation_steps) == (12, 2, 2)
    assert config(tmp_path, data, global_batch_size=None).resolved(4).train_batch_size == 64  # DiT's 256 in all
    with pytest.raises(ValueError, match="global_batch_size 256"):
        config(tmp_path, data, global_batch_size=None).resolved(3)
    for kw, name in ((dict(global_batch_size=6), "global_batch_size"), (dict(preset="MoH-DiT-Huge"), "preset"),
                     (dict(latents_dir="x"), "latents_dir"), (dict(max_steps=0), "max_steps"),
                     (dict(ema_decay=1.0), "ema_decay"), (dict(preset="DiT-Tiny", router_warmup_steps=2),
                                                          "router_warmup_steps")):
        with pytest.raises(ValueError, match=name):
            config(tmp_path, data, **kw).resolved(4)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_bad_data_found_after_the_folder_was_taken_blocks_no_rerun(tmp_path):
    data = make_image_folder(tmp_path / "data", per_class=2)
    (data / "blue" / "0.png").write_bytes(b"not a png at all")
    with pytest.raises(OSError, match="0.png"):
        train(config(tmp_path, data))
    assert not (tmp_path / "run").exists()
    (data / "blue" / "0.png").unlink()
    train(config(tmp_path, data, max_steps=2))
    (data / "red" / "1.png").write_bytes(b"broken")
    with pytest.warns(UserWarning, match="1.png"):
        train(config(tmp_path, data, max_steps=2, on_corrupt="skip", output_dir=str(tmp_path / "b")))
    assert json.loads((tmp_path / "b" / "train_log.jsonl").read_text().splitlines()[-1])["images_skipped"] >= 1


@pytest.mark.slow
def test_the_command_line(tmp_path, data, capsys, refuses, monkeypatch):
    run_dir = tmp_path / "run"
    argv = cli_args(run_dir, data, "--preset", "MoH-DiT-Tiny")
    for flags in (["--checkpoints-total-limit", -1], ["--num-workers", 10000], ["--ema-decay", "nan"],
                  ["--preset", "MoH-DiT-Huge"], ["--report-to", "comet"]):
        refuses("train", argv + flags, flags[0], status=2)
    monkeypatch.setattr(trainer.importlib.util, "find_spec", lambda name: None)  # before any work
    refuses("train", argv + ["--report-to", "wandb"], "report_to wandb is not installed", status=1)
    monkeypatch.undo()
    refuses("train", cli_args(data / "run", data, "--preset", "MoH-DiT-Tiny"), "overlap")  # never inside an input
    cli(*argv, "--dry-run")
    printed = json.loads(capsys.readouterr().out)
    assert (printed["global_batch_size"], printed["train_batch_size"], printed["vae"]) == (4, 4, "none")
    assert not run_dir.exists()
    # diffusers' spellings
    cli("--train_data_dir", data, "--resolution", 16, "--output_dir", run_dir, "--max_train_steps", 2,
        "--train_batch_size", 2, "--gradient_accumulation_steps", 2, "--checkpointing_steps", 2, "--report_to", "none",
        "--mixed_precision", "no", "--dataloader_num_workers", 0, "--preset", "MoH-DiT-Tiny", "--vae", "none",
        "--log-every", 1)
    assert json.loads((run_dir / "train_config.json").read_text())["global_batch_size"] == 4
    # a finished run's folder: a fresh run is refused; a resume without --preset or data takes the run's settings
    refuses("train", argv, f"already exists.*{run_dir}")
    cli("--output-dir", run_dir, "--resume", "latest", "--max-steps", 4)
    record = json.loads((run_dir / "train_config.json").read_text())
    assert (record["preset"], record["max_steps"], record["data_dir"], record["image_size"]) == \
        ("MoH-DiT-Tiny", 4, str(data), 16)
    assert log_steps(run_dir) == [1, 2, 3, 4]
    refuses("train", ["--output-dir", run_dir, "--resume", "latest", "--preset", "MoH-DiT-Tiny/2"], "patch_size")


@pytest.mark.slow
def test_a_killed_run_resumes_at_once_though_its_data_workers_outlive_it(tmp_path, data):
    """The lock dies with the process that took it: forked DataLoader workers (here kept alive by
    a stalled dataset) never hold it, so ``--resume latest`` right after a SIGKILL goes on."""
    import signal
    import subprocess

    run = tmp_path / "run"
    argv = [str(a) for a in cli_args(run, data, "--preset", "MoH-DiT-Tiny", "--max-steps", 1000, "--checkpoint-every",
                                     1, "--num-workers", 2)]
    code = ("import sys, time, moh_dit.data.datasets as d\n"
            "real = d.ImageFolderDataset.__getitem__\n"
            "d.ImageFolderDataset.__getitem__ = lambda self, key: time.sleep(0.5) or real(self, key)\n"
            "from moh_dit.commands import run; run('train', sys.argv[1:])\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    victim = subprocess.Popen([sys.executable, "-c", code, *argv], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while find_latest_checkpoint(run) is None:
        assert victim.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    workers = [int(pid) for pid in Path(f"/proc/{victim.pid}/task/{victim.pid}/children").read_text().split()]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert workers and all(Path(f"/proc/{pid}").exists() for pid in workers)  # alive, holding the lock file open
    step = int(find_latest_checkpoint(run).name.split("-")[1])
    cli("--output-dir", run, "--resume", "latest", "--max-steps", step + 1)
    assert (run / "final").is_dir()
