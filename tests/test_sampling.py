"""Sampling at scale: per-index labels and seeds, DiT's quantisation, the streamed ADM .npz, the
same images for any batch size or process count, resume, load_pipeline and the command's flags."""

import functools
import json

import numpy as np
import PIL.Image
import pytest
import torch

from moh_dit import MoHDiTPipeline
from moh_dit.commands import build_parser, sample as command
from moh_dit.diffusion import make_scheduler
from moh_dit.sampling import (CONFIG_FILE, class_labels_for, generate, load_pipeline, png_path, sample,
                              sample_images, to_uint8, write_npz)

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = dict(guidance_scale=1.5, num_inference_steps=2, class_labels="uniform", seed=7)


@pytest.fixture
def sampling_pipe(tiny_pipe):
    # float64: CPU matmuls then give bit-identical per-image results for any batch size
    # (float32 ones differ by ~1e-6, which can flip a uint8 level).
    return functools.partial(tiny_pipe, seed=4, dtype=torch.float64, clip_sample=True)


@pytest.fixture
def model_dir(tmp_path, sampling_pipe):
    sampling_pipe(dtype=torch.float32).transformer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def read_pngs(folder, n):
    return np.stack([np.asarray(PIL.Image.open(png_path(folder, i))) for i in range(n)])


def parse(argv):
    return build_parser("sample").parse_args([str(a) for a in argv])


def test_class_labels_balanced_and_per_index():
    labels = class_labels_for(range(50_000), 1000)
    assert labels.dtype == np.int64 and np.bincount(labels, minlength=1000).tolist() == [50] * 1000
    assert np.bincount(labels[:5000], minlength=1000).tolist() == [5] * 1000  # every IS split balanced
    uniform = class_labels_for(range(2000), 10, "uniform", seed=3)
    assert class_labels_for([1500, 7], 10, "uniform", seed=3).tolist() == [uniform[1500], uniform[7]]
    assert not np.array_equal(uniform, class_labels_for(range(2000), 10, "uniform", seed=4))
    assert min(np.bincount(uniform)) > 150


def test_to_uint8_is_dits_rule():
    x = torch.tensor([-2.0, -1.0, -0.999, 0.0, 0.5, 0.99, 1.0, 3.0]).reshape(1, 1, 1, 8).expand(1, 3, 1, 8)
    q = to_uint8(x)
    assert q.shape == (1, 1, 8, 3) and q.dtype == np.uint8
    assert q[0, 0, :, 0].tolist() == [0, 0, 0, 128, 191, 254, 255, 255]  # floor(clamp(127.5 x + 128))


def test_npz_streams_pngs_with_labels(tmp_path):
    from moh_dit.sampling import save_png

    images = np.random.default_rng(0).integers(0, 256, size=(4, 6, 5, 3), dtype=np.uint8)
    for i, image in enumerate(images):
        save_png(png_path(tmp_path, i), image)
    with np.load(write_npz(tmp_path, 4, [3, 0, 2, 1])) as data:
        assert data.files == ["arr_0", "arr_1"] and data["arr_1"].dtype == np.int64
        np.testing.assert_array_equal(data["arr_0"], images)
        assert data["arr_1"].tolist() == [3, 0, 2, 1]
    with np.load(write_npz(tmp_path, 3)) as data:
        assert data.files == ["arr_0"] and data["arr_0"].shape == (3, 6, 5, 3)
    save_png(png_path(tmp_path, 4), images[0, :3])
    with pytest.raises(ValueError, match="000004.png"):
        write_npz(tmp_path, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples", "samples.npz"]  # no scratch left


def test_same_images_for_any_batch_size_and_process_count(tmp_path, sampling_pipe):
    pipe = sampling_pipe()
    assert sample_images(pipe, tmp_path / "a", 4, batch_size=1, progress=False, **SETTINGS) == 4
    for rank in range(2):
        sample_images(pipe, tmp_path / "b", 4, batch_size=3, rank=rank, world_size=2, progress=False, **SETTINGS)
    a, b = read_pngs(tmp_path / "a", 4), read_pngs(tmp_path / "b", 4)
    np.testing.assert_array_equal(a, b)
    assert a.std() > 10 and len({img.tobytes() for img in a}) == 4
    # Image 3 alone through the pipeline: its class and seed follow from the index.
    label = class_labels_for([3], 10, "uniform", seed=7).tolist()
    latents = pipe(label, guidance_scale=1.5, num_inference_steps=2, seeds=[7 + 3], output_type="latent").images
    np.testing.assert_array_equal(to_uint8(latents)[0], a[3])


def test_sampling_at_scale_computes_no_head_usage(tmp_path, sampling_pipe):
    pipe = sampling_pipe()
    asked, original = [], pipe.transformer.forward
    pipe.transformer.forward = lambda *a, **k: (asked.append(k.get("output_head_usage", False)), original(*a, **k))[1]
    assert sample_images(pipe, tmp_path / "run", 4, batch_size=3, progress=False, **SETTINGS) == 4
    assert len(asked) == 2 * 2 and not any(asked)  # two batches, two steps each


def test_resume_after_interruption(tmp_path, sampling_pipe):
    pipe = sampling_pipe()
    sample_images(pipe, tmp_path / "full", 4, batch_size=4, progress=False, **SETTINGS)
    calls, original = [], type(pipe).__call__

    def killed_at_the_second_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(type(pipe), "__call__", killed_at_the_second_batch)
        sample_images(pipe, tmp_path / "run", 4, batch_size=2, progress=False, **SETTINGS)
    assert sorted(p.name for p in (tmp_path / "run" / "samples").iterdir()) == ["000000.png", "000001.png"]
    assert sample_images(pipe, tmp_path / "run", 4, batch_size=3, progress=False, **SETTINGS) == 2
    np.testing.assert_array_equal(read_pngs(tmp_path / "run", 4), read_pngs(tmp_path / "full", 4))
    assert sample_images(pipe, tmp_path / "run", 4, batch_size=2, progress=False, **SETTINGS) == 0


def test_sample_writes_the_folder_resumes_and_refuses_other_settings(tmp_path, model_dir, capsys):
    out = tmp_path / "out"
    kwargs = dict(num_samples=4, batch_size=3, num_inference_steps=2, head_activation_ratio=0.6, progress=False)
    config = sample(model_dir, out, **kwargs)
    with np.load(out / "samples.npz") as data:
        arr, labels = data["arr_0"], data["arr_1"]
    assert arr.shape == (4, 8, 8, 3) and arr.dtype == np.uint8
    assert labels.tolist() == [0, 1, 2, 3]  # ADM's arr_1: balanced, class i mod num_classes
    np.testing.assert_array_equal(arr, read_pngs(out, 4))
    assert json.loads((out / CONFIG_FILE).read_text()) == config
    assert config["head_activation_ratio"] == 0.6 and config["scheduler"]["clip_sample"] is True
    assert json.loads((out / ".moh-dit-output.json").read_text())["written_by"] == "moh-dit sample"
    # The images are the pipeline's at that ratio: image i is class i, seed i.
    pipe = load_pipeline(model_dir)
    np.testing.assert_array_equal(generate(pipe, range(4), num_inference_steps=2, head_activation_ratio=0.6)[0], arr)
    # Other settings would mix two sample sets: refused, nothing changed.
    before = (out / CONFIG_FILE).read_text()
    with pytest.raises(ValueError, match="guidance_scale"):
        sample(model_dir, out, **{**kwargs, "guidance_scale": 2.0})
    assert (out / CONFIG_FILE).read_text() == before
    # Growing the set keeps the first images and makes only the new ones.
    sample(model_dir, out, **{**kwargs, "num_samples": 6})
    with np.load(out / "samples.npz") as data:
        np.testing.assert_array_equal(data["arr_0"][:4], arr)
        assert data["arr_1"].tolist() == [0, 1, 2, 3, 4, 5]


def test_a_schedule_samples_the_pipelines_images(tmp_path, model_dir):
    sample(model_dir, tmp_path / "out", num_samples=3, batch_size=2, num_inference_steps=2, npz=False,
           head_activation_ratio="linear:0.5:1.0", progress=False)
    pipe = load_pipeline(model_dir)
    latents = pipe([0, 1, 2], guidance_scale=1.5, num_inference_steps=2, head_activation_ratio="linear:0.5:1.0",
                   guidance_channels="dit", seeds=[0, 1, 2], output_type="latent").images
    np.testing.assert_array_equal(read_pngs(tmp_path / "out", 3), to_uint8(latents))
    assert not (tmp_path / "out" / "samples.npz").exists()


@pytest.mark.slow
def test_load_pipeline_takes_pipeline_run_and_transformer_folders(tmp_path, sampling_pipe, tiny_vae):
    pipe = sampling_pipe(dtype=torch.float32, clip_sample=False)
    pipe.scheduler = make_scheduler("ddim")
    pipe.save_pretrained(tmp_path / "run" / "final")
    (tmp_path / "run" / "train_config.json").write_text("{}")
    kwargs = dict(guidance_scale=1.5, num_inference_steps=2, seeds=[0, 1], output_type="np")
    ours = load_pipeline(tmp_path / "run")  # the run's final/, with its own scheduler
    assert type(ours.scheduler).__name__ == "DDIMScheduler"
    np.testing.assert_array_equal(ours([1, 2], **kwargs).images,
                                  MoHDiTPipeline.from_pretrained(tmp_path / "run" / "final")([1, 2], **kwargs).images)
    ddpm = load_pipeline(tmp_path / "run", scheduler="ddpm", dtype=torch.float64)
    assert ddpm.scheduler.config.clip_sample is True and ddpm.transformer.dtype == torch.float64
    assert load_pipeline(tmp_path / "run" / "final" / "transformer").scheduler.config.variance_type == "learned_range"
    tiny_vae().save_pretrained(tmp_path / "vae")
    assert load_pipeline(tmp_path / "run", vae=str(tmp_path / "vae")).vae is not None
    assert load_pipeline(tmp_path / "run", vae="none").vae is None
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "train_config.json").write_text("{}")
    for folder in ("unfinished", "nothing"):
        with pytest.raises(FileNotFoundError) as caught:
            load_pipeline(tmp_path / folder)
        assert caught.value.filename.startswith(str(tmp_path / folder))


def test_a_latent_model_without_its_vae_is_refused(tmp_path):
    from moh_dit import MoHDiTTransformer2DModel

    latent = MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, in_channels=4)
    latent.save_pretrained(tmp_path / "latent")
    with pytest.raises(ValueError, match="VAE"):
        load_pipeline(tmp_path / "latent")


def test_the_commands_flags(tmp_path, capsys):
    args = parse(["--model", "m", "--output", tmp_path / "o", "--vae", "none", "--per-device-batch-size", "8",
                  "--head-activation-ratio", "linear:0.5:1", "--scheduler", "ddim", "--clip-sample", "no"])
    assert args.output_dir == str(tmp_path / "o") and args.vae == "none" and args.batch_size == 8
    assert args.head_activation_ratio == "linear:0.5:1"
    assert parse(["--model", "m", "--output_dir", "o", "--head-activation-ratio", "0.75"]).head_activation_ratio == 0.75
    for bad in (["--num-samples", "0"], ["--per-device-batch-size", "-4"], ["--num-inference-steps", "2.5"],
                ["--head-activation-ratio", "half"], ["--scheduler", "euler"], ["--class-labels", "random"],
                ["--seed", "-1"], ["--num-samples", str(10**9)]):
        with pytest.raises(SystemExit) as caught:
            parse(["--model", "m", "--output-dir", "o", *bad])
        assert caught.value.code == 2 and bad[0] in capsys.readouterr().err


def test_the_command_samples_and_dry_runs(tmp_path, model_dir, capsys):
    base = ["--model", model_dir, "--num-samples", "2", "--num-inference-steps", "1", "--guidance-scale", "1"]
    command.main(parse(base + ["--output", tmp_path / "dry", "--dry-run", "--class-labels", "uniform"]))
    printed = json.loads(capsys.readouterr().out)
    assert printed["class_labels"] == "uniform" and printed["scheduler"]["_class_name"] == "DDPMScheduler"
    assert not (tmp_path / "dry").exists()
    command.main(parse(base + ["--output", tmp_path / "out", "--no-npz", "--dtype", "bfloat16"]))
    assert sorted(p.name for p in (tmp_path / "out" / "samples").iterdir()) == ["000000.png", "000001.png"]
    assert json.loads((tmp_path / "out" / CONFIG_FILE).read_text())["dtype"] == "torch.bfloat16"


@pytest.mark.slow
def test_two_processes_make_the_images_of_one(tmp_path, model_dir):
    """scripts/sample.py under torchrun (two processes, gloo on CPU): rank 0 takes the folder, both
    sample their indices, rank 0 writes the npz; the same file as one process. (Batch size 1 on both
    sides: float32 results of other batch sizes may differ in the last bit, see sampling_pipe.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "sample.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1")
    env.pop("WORLD_SIZE", None)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
                    "--model", model_dir, "--output", tmp_path / "two", "--num-samples", "5", "--num-inference-steps",
                    "2", "--per-device-batch-size", "1", "-q"], env=env, check=True, timeout=300)
    sample(model_dir, tmp_path / "one", num_samples=5, batch_size=1, num_inference_steps=2, progress=False)
    with np.load(tmp_path / "two" / "samples.npz") as two, np.load(tmp_path / "one" / "samples.npz") as one:
        assert two.files == one.files == ["arr_0", "arr_1"]
        for key in one.files:
            np.testing.assert_array_equal(two[key], one[key])
    assert (tmp_path / "two" / CONFIG_FILE).read_text() == (tmp_path / "one" / CONFIG_FILE).read_text()
