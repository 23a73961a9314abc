"""Sampling at scale: labels, index ownership, DiT quantisation, the streamed ADM .npz,
determinism across batch sizes and process counts, resume, and scripts/sample.py."""

import json

import numpy as np
import PIL.Image
import pytest
import torch

from moh_dit import MoHDiTPipeline, MoHDiTTransformer2DModel
from moh_dit.pipelines.pipeline_moh_dit import make_scheduler
from moh_dit.sampling import (
    SETTINGS_FILE,
    SampleSettings,
    class_labels_for,
    indices_for_rank,
    png_path,
    quantize_dit,
    sample_images,
    save_png_atomic,
    write_adm_npz,
)

def tiny_pipe(randomize, dtype=torch.float64):
    # float64: CPU matmuls then give bit-identical per-image results for any batch size
    # (float32 ones differ by ~1e-6, which can flip a uint8 level).
    model = randomize(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8), seed=4).eval().to(dtype)
    return MoHDiTPipeline(transformer=model, scheduler=make_scheduler("ddpm", clip_sample=True))


def read_pngs(folder, n):
    return np.stack([np.asarray(PIL.Image.open(png_path(folder, i))) for i in range(n)])


SETTINGS = SampleSettings(num_samples=4, guidance_scale=1.5, num_inference_steps=2, class_labels="uniform", seed=7)


def test_class_labels_balanced_and_per_index():
    labels = class_labels_for(range(50_000), 1000, "balanced")
    assert np.bincount(labels, minlength=1000).tolist() == [50] * 1000
    assert np.bincount(labels[:5000], minlength=1000).tolist() == [5] * 1000  # every IS split balanced
    uniform = class_labels_for(range(2000), 10, "uniform", seed=3)
    assert class_labels_for([1500, 7], 10, "uniform", seed=3) == [uniform[1500], uniform[7]]
    assert uniform != class_labels_for(range(2000), 10, "uniform", seed=4)
    assert 150 < min(np.bincount(uniform, minlength=10))
    with pytest.raises(ValueError, match="class label mode 'random'"):
        class_labels_for([0], 10, "random")


def test_indices_for_rank_partition():
    parts = [indices_for_rank(11, rank, 3) for rank in range(3)]
    assert sorted(sum(parts, [])) == list(range(11)) and parts[1] == [1, 4, 7, 10]
    with pytest.raises(ValueError, match="rank 3 is outside"):
        indices_for_rank(11, 3, 3)


def test_quantize_dit():
    x = torch.tensor([-2.0, -1.0, -0.999, 0.0, 0.5, 0.99, 1.0, 3.0]).reshape(1, 1, 1, 8).expand(1, 3, 1, 8)
    q = quantize_dit(x)
    assert q.shape == (1, 1, 8, 3) and q.dtype == np.uint8
    assert q[0, 0, :, 0].tolist() == [0, 0, 0, 128, 191, 254, 255, 255]  # floor(clamp(127.5 x + 128))


def test_adm_npz_streams_pngs(tmp_path):
    (tmp_path / "samples").mkdir()
    images = np.random.default_rng(0).integers(0, 256, size=(4, 6, 5, 3), dtype=np.uint8)
    for i, image in enumerate(images):
        save_png_atomic(png_path(tmp_path, i), image)
    path = write_adm_npz(tmp_path, 4)
    with np.load(path) as data:
        assert list(data.keys()) == ["arr_0"]
        np.testing.assert_array_equal(data["arr_0"], images)
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(FileNotFoundError, match=r"1 of 5 PNGs are missing.*000004\.png"):
        write_adm_npz(tmp_path, 5, tmp_path / "five.npz")
    save_png_atomic(png_path(tmp_path, 4), images[0, :3])
    with pytest.raises(ValueError, match="mixes runs"):
        write_adm_npz(tmp_path, 5, tmp_path / "five.npz")
    assert not (tmp_path / "five.npz").exists() and not list(tmp_path.glob("*.tmp"))


def test_same_images_for_any_batch_size_and_process_count(tmp_path, randomize):
    pipe = tiny_pipe(randomize)
    assert sample_images(pipe, tmp_path / "a", SETTINGS, batch_size=1, progress=False) == 4
    for rank in range(2):
        sample_images(pipe, tmp_path / "b", SETTINGS, batch_size=3, rank=rank, world_size=2, progress=False)
    a, b = read_pngs(tmp_path / "a", 4), read_pngs(tmp_path / "b", 4)
    np.testing.assert_array_equal(a, b)
    assert a.std() > 10 and len({img.tobytes() for img in a}) == 4
    # Image 3 alone through the pipeline: class label and seed follow the index.
    label = class_labels_for([3], 10, "uniform", seed=7)
    latents = pipe(label, guidance_scale=1.5, num_inference_steps=2, seeds=[7 + 3], output_type="latent").images
    np.testing.assert_array_equal(quantize_dit(latents)[0], a[3])


def test_resume_after_interruption(tmp_path, randomize):
    pipe = tiny_pipe(randomize)
    sample_images(pipe, tmp_path / "full", SETTINGS, batch_size=4, progress=False)

    def crash(batch):
        raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        sample_images(pipe, tmp_path / "run", SETTINGS, batch_size=2, progress=False, on_batch=crash)
    done = sorted(p.name for p in (tmp_path / "run" / "samples").glob("*.png"))
    assert done == ["000000.png", "000001.png"]
    (tmp_path / "run" / "samples" / "000002.png.tmp").write_bytes(b"half-written")  # a crash mid-write
    made = []
    assert sample_images(pipe, tmp_path / "run", SETTINGS, batch_size=2, progress=False, on_batch=made.extend) == 2
    assert made == [2, 3]
    np.testing.assert_array_equal(read_pngs(tmp_path / "run", 4), read_pngs(tmp_path / "full", 4))
    assert sample_images(pipe, tmp_path / "run", SETTINGS, batch_size=2, progress=False) == 0


def test_script_end_to_end_and_resume_checks(tmp_path, randomize, load_script):
    script = load_script("sample")
    model_dir, out = tmp_path / "model", tmp_path / "out"
    tiny_pipe(randomize, torch.float32).transformer.save_pretrained(model_dir)
    argv = ["--model", str(model_dir), "--output", str(out), "--num-samples", "4", "--per-device-batch-size", "3",
            "--num-inference-steps", "2", "--guidance-scale", "1.5", "--head-activation-ratio", "0.6"]
    assert script.main(script.parse_args(argv)) == 0
    with np.load(out / "samples.npz") as data:
        arr = data["arr_0"]
    assert arr.shape == (4, 8, 8, 3) and arr.dtype == np.uint8
    np.testing.assert_array_equal(arr, read_pngs(out, 4))
    saved = json.loads((out / SETTINGS_FILE).read_text())
    identity, run = saved["identity"], saved["run"]
    assert identity["guidance_scale"] == 1.5 and identity["head_activation_ratio"] == 0.6
    assert identity["scheduler"]["variance_type"] == "learned_range" and identity["scheduler"]["clip_sample"] is True
    assert run["realised_head_activation_ratio"] == pytest.approx(14 / 24) and run["num_processes"] == 1

    # A resumed run must use the same settings; nothing is written when it does not.
    before = (out / SETTINGS_FILE).read_text()
    with pytest.raises(ValueError, match="different settings.*guidance_scale"):
        script.main(script.parse_args(argv[:-4] + ["--guidance-scale", "2.0", "--head-activation-ratio", "0.6"]))
    assert (out / SETTINGS_FILE).read_text() == before
    # Growing the set keeps the first images and makes only the new ones.
    grown = argv[:5] + ["6"] + argv[6:]
    assert script.main(script.parse_args(grown)) == 0
    with np.load(out / "samples.npz") as data:
        np.testing.assert_array_equal(data["arr_0"][:4], arr)
        assert data["arr_0"].shape[0] == 6


def test_script_rejects_bad_ratio_before_writing(tmp_path, randomize, load_script):
    script = load_script("sample")
    tiny_pipe(randomize, torch.float32).transformer.save_pretrained(tmp_path / "model")
    args = script.parse_args(["--model", str(tmp_path / "model"), "--output", str(tmp_path / "out"),
                              "--head-activation-ratio", "0.2"])
    with pytest.raises(ValueError, match=r"outside the reachable range \[0\.5000, 1\.0\]"):
        script.main(args)
    assert not (tmp_path / "out").exists()


def test_script_pipeline_folder_and_dry_run(tmp_path, randomize, capsys, load_script):
    script = load_script("sample")
    pipe = tiny_pipe(randomize, torch.float32)
    pipe.scheduler = make_scheduler("ddim")
    pipe.save_pretrained(tmp_path / "pipe")
    args = script.parse_args(["--model", str(tmp_path / "pipe"), "--output", str(tmp_path / "out"),
                              "--scheduler", "saved", "--dry-run", "--class-labels", "uniform"])
    assert script.main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["identity"]["scheduler"]["_class_name"] == "DDIMScheduler"
    assert printed["identity"]["class_labels"] == "uniform" and printed["identity"]["guidance_channels"] == "dit"
    assert not (tmp_path / "out").exists()
