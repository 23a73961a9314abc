import json
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image

import moh_dit.data.latents as latents_mod
from moh_dit.data.datasets import CorruptImageError, ImageFolderDataset, flip_for
from moh_dit.data.latents import LatentDataset, encode_distribution, extract_latents, load_vae
from moh_dit.errors import InvalidInput

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE = 32  # image size; the tiny VAE downsamples by 8 -> 4x4 latents


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory, tiny_vae):
    path = tmp_path_factory.mktemp("vae") / "tiny-vae"
    tiny_vae(levels=4, sample_size=SIZE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("images") / "data"
    rng = np.random.default_rng(0)
    for c, cls in enumerate(["dog", "cat", "bird"]):
        for i in range(3 if c else 2):
            # Non-square, larger than SIZE: the centre crop and bicubic resize both matter.
            h, w = rng.integers(36, 60, size=2)
            (root / cls).mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def cache(vae_dir, image_dir, tmp_path_factory, load_script):
    out = tmp_path_factory.mktemp("cache") / "latents"
    script = load_script("extract_latents")
    args = script.parse_args(
        ["--data-dir", str(image_dir), "--vae", str(vae_dir), "--image-size", str(SIZE), "--output-dir", str(out),
         "--batch-size", "2", "--shard-size", "3", "--num-workers", "0", "--device", "cpu"]
    )
    script.main(args)
    return out


def test_cache_layout_and_dataset(cache, image_dir, vae_dir):
    index = json.loads((cache / "index.json").read_text())
    images = ImageFolderDataset(image_dir, SIZE)
    assert index["num_samples"] == len(images) == 8
    assert index["latent_shape"] == [4, 4, 4] and index["dtype"] == "float32"
    assert index["classes"] == ["bird", "cat", "dog"] and index["class_to_idx"] == images.class_to_idx
    assert index["scaling_factor"] == pytest.approx(0.18215) and index["vae"] == str(vae_dir)
    assert [s["count"] for s in index["shards"]] == [3, 3, 2]
    assert json.loads((cache / "files.json").read_text()) == [str(Path(p).relative_to(image_dir)) for p, _ in images.samples]
    shard = np.load(cache / "shard_00000.npy", mmap_mode="r")
    assert isinstance(shard, np.memmap) and shard.shape == (3, 2, 2, 4, 4, 4)
    # Only the finished files remain: no markers, temporaries or partial folder.
    assert sorted(p.name for p in cache.iterdir()) == [".moh-dit-output.json", "files.json", "index.json",
                                                       "labels.npy"] + [f"shard_0000{k}.npy" for k in range(3)]
    assert json.loads((cache / ".moh-dit-output.json").read_text())["written_by"] == "moh-dit extract-latents"
    assert sorted(p.name for p in cache.parent.iterdir()) == ["latents"]

    ds = LatentDataset(cache)
    assert len(ds) == 8 and ds.num_classes == 3
    latent, label = ds[5]
    assert latent.shape == (4, 4, 4) and latent.dtype == torch.float32
    assert [ds[i][1] for i in range(8)] == images.targets
    assert torch.equal(ds[(5, 2)][0], ds[(5, 2)][0])
    assert not torch.equal(ds[(5, 2)][0], ds[(5, 3)][0])
    # Memory maps are not pickled into DataLoader workers.
    assert len(pickle.dumps(ds)) < 10_000 and ds._shards is not None
    with pytest.raises(IndexError):
        ds.stats(8, False)


def test_cache_equals_on_the_fly_encoding(cache, image_dir, vae_dir):
    vae = load_vae(vae_dir)
    images = ImageFolderDataset(image_dir, SIZE, seed=11)
    means = LatentDataset(cache, seed=11, sample_posterior=False)
    for i in range(len(images)):
        for flip in (False, True):
            mean, std = encode_distribution(vae, images.load(i, flip)[None])
            stored_mean, stored_std = means.stats(i, flip)
            np.testing.assert_allclose(stored_mean, mean[0].numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(stored_std, std[0].numpy(), rtol=1e-5, atol=1e-5)
        # The flip decision of the latent dataset is the image dataset's.
        for epoch in range(3):
            flip = flip_for(11, epoch, i)
            expected = encode_distribution(vae, images[(i, epoch)][0][None])[0][0] * 0.18215
            torch.testing.assert_close(means[(i, epoch)][0], expected, rtol=1e-5, atol=1e-5)
            assert torch.equal(means[(i, epoch)][0], torch.from_numpy(means.stats(i, flip)[0] * np.float32(0.18215)))


def test_sampled_latents_follow_the_stored_distribution(cache):
    ds = LatentDataset(cache, random_flip=False, seed=0)
    mean, std = ds.stats(3, False)
    draws = torch.stack([ds[(3, epoch)][0] for epoch in range(3000)]).numpy()
    n = draws.shape[0]
    # Mean within 5 standard errors per element, std within 10%.
    assert np.all(np.abs(draws.mean(0) - mean * 0.18215) < 5 * std * 0.18215 / np.sqrt(n))
    np.testing.assert_allclose(draws.std(0), std * 0.18215, rtol=0.1)


def test_corrupt_images(vae_dir, image_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(image_dir, data)
    (data / "cat" / "zz_broken.png").write_bytes(b"not an image at all")
    out = tmp_path / "out"
    # The error crosses a DataLoader worker and still names the file; no cache is created.
    with pytest.raises(CorruptImageError, match="zz_broken.png"):
        extract_latents(data, vae_dir, out, SIZE, batch_size=4, num_workers=1, device="cpu", progress=False)
    assert not out.exists()
    # Skipping resumes the same partial extraction (on_corrupt does not change finished shards).
    extract_latents(data, vae_dir, out, SIZE, batch_size=4, num_workers=0, device="cpu", on_corrupt="skip", progress=False)
    index = json.loads((out / "index.json").read_text())
    assert index["num_skipped"] == 1 and index["skipped"] == ["cat/zz_broken.png"]
    ds = LatentDataset(out)
    assert len(ds) == 8 and [ds[i][1] for i in range(8)] == ImageFolderDataset(image_dir, SIZE).targets


def test_the_summary_is_the_commands_and_quiet_hides_it(vae_dir, image_dir, tmp_path, load_script, capsys):
    extract_latents(image_dir, vae_dir, tmp_path / "lib", SIZE, batch_size=8, num_workers=0, device="cpu")
    assert capsys.readouterr().out == ""  # a Python caller sees no prints
    script = load_script("extract_latents")
    argv = ["--data-dir", str(image_dir), "--vae", str(vae_dir), "--image-size", str(SIZE), "--batch-size", "8",
            "--num-workers", "0", "--device", "cpu"]
    assert script.cli(argv + ["--output-dir", str(tmp_path / "cli")]) == 0
    assert "cached 8 latents of shape [4, 4, 4]" in capsys.readouterr().out
    assert script.cli(argv + ["--output-dir", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")  # neither the summary nor the progress bar
    assert (tmp_path / "quiet" / "index.json").is_file()


def test_empty_or_wrong_inputs_fail_before_work(tmp_path, cache, image_dir, vae_dir):
    (tmp_path / "empty").mkdir()
    # The folder is checked before the (here nonexistent) VAE is loaded.
    with pytest.raises(InvalidInput, match="empty") as error:  # no class subfolders
        extract_latents(tmp_path / "empty", tmp_path / "no-vae", tmp_path / "o", SIZE, progress=False)
    assert error.value.parameters == ("data_dir",)
    with pytest.raises(FileExistsError, match="already exists"):
        extract_latents(image_dir, vae_dir, cache, SIZE, progress=False)
    with pytest.raises(InvalidInput, match="36") as error:  # not a multiple of the VAE's downsampling
        extract_latents(image_dir, vae_dir, tmp_path / "o", 36, device="cpu", progress=False)
    assert error.value.parameters == ("image_size",)
    with pytest.raises(OSError, match="cannot load an AutoencoderKL"):
        extract_latents(image_dir, tmp_path / "no-vae", tmp_path / "o", SIZE, device="cpu", progress=False)
    with pytest.raises(ValueError, match="not a latent cache"):
        LatentDataset(image_dir)


def test_interrupted_extraction_resumes_by_shard(vae_dir, image_dir, tmp_path, monkeypatch):
    out = tmp_path / "latents"
    calls = []
    real = latents_mod.encode_distribution

    def flaky(vae, images):
        calls.append(images.shape[0])
        if len(calls) == 3:  # first batch of the second shard (2 batches per shard)
            raise KeyboardInterrupt
        return real(vae, images)

    monkeypatch.setattr(latents_mod, "encode_distribution", flaky)
    kwargs = dict(batch_size=2, shard_size=4, num_workers=0, device="cpu", progress=False)
    with pytest.raises(KeyboardInterrupt):
        extract_latents(image_dir, vae_dir, out, SIZE, **kwargs)
    partial = tmp_path / ".latents.partial"
    assert not out.exists() and sorted(p.name for p in partial.iterdir()) == [
        "progress.json", "shard_00000.json", "shard_00000.npy"
    ]
    # Other settings do not silently mix with the unfinished cache.
    with pytest.raises(FileExistsError, match="unfinished extraction"):
        extract_latents(image_dir, vae_dir, out, SIZE, **{**kwargs, "shard_size": 3})
    calls.clear()
    monkeypatch.setattr(latents_mod, "encode_distribution", lambda vae, images: (calls.append(1), real(vae, images))[1])
    extract_latents(image_dir, vae_dir, out, SIZE, **kwargs)
    assert len(calls) == 2 and not partial.exists()
    # The resumed cache equals one made in a single go.
    whole = extract_latents(image_dir, vae_dir, tmp_path / "whole", SIZE, **kwargs)
    for k in range(2):
        np.testing.assert_array_equal(np.load(out / f"shard_0000{k}.npy"), np.load(whole / f"shard_0000{k}.npy"))


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_overwrite_keeps_the_old_cache_until_the_new_one_is_complete(vae_dir, image_dir, tmp_path, monkeypatch):
    out = tmp_path / "latents"
    kwargs = dict(batch_size=4, shard_size=4, num_workers=0, device="cpu", progress=False)
    extract_latents(image_dir, vae_dir, out, SIZE, **kwargs)
    before = _tree(out)
    real = latents_mod.encode_distribution
    calls = []

    def failing(vae, images):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("power cut")
        return real(vae, images)

    monkeypatch.setattr(latents_mod, "encode_distribution", failing)
    with pytest.raises(RuntimeError, match="power cut"):
        extract_latents(image_dir, vae_dir, out, SIZE, overwrite=True, **{**kwargs, "dtype": "float16"})
    assert _tree(out) == before  # the old cache is untouched while the new one is unfinished
    monkeypatch.setattr(latents_mod, "encode_distribution", real)
    extract_latents(image_dir, vae_dir, out, SIZE, overwrite=True, **{**kwargs, "dtype": "float16"})
    assert json.loads((out / "index.json").read_text())["dtype"] == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latents"]  # no partial or old folder left


def test_overwrite_never_replaces_a_folder_that_is_not_a_latent_cache(vae_dir, image_dir, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match="not a latent cache"):
        extract_latents(image_dir, vae_dir, precious, SIZE, overwrite=True, device="cpu", progress=False)
    assert (precious / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"]


@pytest.fixture
def latent_inputs(tmp_path, image_dir, vae_dir):
    """Valid scripts/extract_latents.py flags; each bad-flag row changes one thing."""
    shutil.copytree(image_dir, tmp_path / "data")
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "notes.txt").write_text("mine")
    (tmp_path / "alias").symlink_to(tmp_path / "data", target_is_directory=True)
    return {
        "--data-dir": tmp_path / "data", "--vae": vae_dir, "--image-size": str(SIZE), "--output-dir": tmp_path / "out",
        "--num-workers": "0", "--device": "cpu",
    }  # fmt: skip


@pytest.mark.parametrize(
    "change, extra, match",
    [
        ({"--image-size": "0"}, [], "--image-size .*got 0"),
        ({"--image-size": "-32"}, [], "--image-size .*got -32"),
        ({"--image-size": "36"}, [], "--image-size 36 .*downsampling factor 8"),
        ({"--image-size": "3.5"}, [], "invalid int value"),
        ({"--batch-size": "0"}, [], "--batch-size .*got 0"),
        ({"--shard-size": "0"}, [], "--shard-size .*got 0"),
        ({"--shard-size": "-1"}, [], "--shard-size .*got -1"),
        ({"--num-workers": "-1"}, [], "--num-workers .*got -1"),
        ({"--data-dir": "{tmp}/missing"}, [], "--data-dir .*missing' does not exist"),
        ({"--data-dir": "{tmp}/a_file"}, [], "--data-dir .*a_file' does not exist"),
        ({"--data-dir": "{tmp}/empty"}, [], "--data-dir .*empty' has no class subfolders"),
        ({"--output-dir": "{tmp}/existing"}, [], "already exists.*--overwrite"),
        ({"--output-dir": "{tmp}/existing"}, ["--overwrite"], "not a latent cache"),
        ({"--output-dir": "{tmp}/a_file"}, ["--overwrite"], "exists and is not a folder"),
        ({"--output-dir": "{tmp}/a_file/cache"}, [], "is a file"),
        ({"--output-dir": "{tmp}/data/cache"}, [], "--output-dir .*data/cache lies inside --data-dir"),
        ({"--output-dir": "{tmp}/data"}, ["--overwrite"], "--output-dir .*data is --data-dir"),
        ({"--output-dir": "{tmp}"}, ["--overwrite"], "--output-dir .* contains --data-dir"),
        ({"--output-dir": "{tmp}/alias/cache"}, [], "lies inside --data-dir"),  # through a link
        ({"--batch-size": "1000000000000"}, [], r"--batch-size 1000000000000 at --image-size 32 .*memory"),
        ({"--vae": "{tmp}/no-vae"}, [], "no-vae"),
        ({"--device": "gpu"}, [], "--device .*'gpu'"),
        ({"--on-corrupt": "ignore"}, [], "invalid choice"),
        ({"--dtype": "bfloat16"}, [], "invalid choice"),
    ]
    + ([] if torch.cuda.is_available() else [({"--device": "cuda"}, [], "CUDA is not available")]),
)
def test_extract_latents_script_refuses_bad_flags(tmp_path, latent_inputs, refuses, change, extra, match):
    flags = {**latent_inputs, **{k: v.format(tmp=tmp_path) for k, v in change.items()}}
    refuses("extract_latents", [item for pair in flags.items() for item in pair] + extra, match)


def test_a_cache_inside_the_vae_folder_is_refused(tmp_path, image_dir, tiny_vae, refuses):
    vae = tmp_path / "vae"
    tiny_vae(levels=4, sample_size=SIZE).save_pretrained(vae)
    argv = ["--data-dir", image_dir, "--vae", vae, "--image-size", SIZE, "--output-dir", vae / "cache",
            "--num-workers", 0, "--device", "cpu"]
    refuses("extract_latents", argv, r"--output-dir .*vae/cache lies inside --vae")


def test_a_second_extraction_into_the_same_folder_is_refused(tmp_path, image_dir, vae_dir, refuses):
    from moh_dit.utils.output_folders import hold_output_folder

    out = tmp_path / "latents"
    argv = ["--data-dir", image_dir, "--vae", vae_dir, "--image-size", SIZE, "--output-dir", out,
            "--num-workers", 0, "--device", "cpu"]
    with hold_output_folder(out, "extract-latents", "--output-dir"):
        refuses("extract_latents", argv, r"--output-dir .*latents is being written by another command "
                                         r"\(moh-dit extract-latents, pid \d+")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_overwrite_replaces_marked_and_older_unmarked_caches(cache, image_dir, vae_dir, tmp_path):
    """--overwrite recognises a cache by its marker, and one from before markers by its index."""
    out = tmp_path / "latents"
    shutil.copytree(cache, out)
    (out / ".moh-dit-output.json").unlink()  # as a cache from before markers
    kwargs = dict(batch_size=8, num_workers=0, device="cpu", progress=False)
    extract_latents(image_dir, vae_dir, out, SIZE, overwrite=True, dtype="float16", **kwargs)
    assert json.loads((out / "index.json").read_text())["dtype"] == "float16"
    extract_latents(image_dir, vae_dir, out, SIZE, overwrite=True, **kwargs)  # marked now
    assert json.loads((out / "index.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latents"]  # no lock, partial or old folder left


def test_the_cache_gets_the_permissions_the_umask_gives(image_dir, vae_dir, tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        out = extract_latents(image_dir, vae_dir, tmp_path / "latents", SIZE, batch_size=8, num_workers=0,
                              device="cpu", progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    files = list(out.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in files)


def test_a_local_vae_is_recorded_by_its_absolute_path(image_dir, vae_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(vae_dir.parent)
    out = extract_latents(image_dir, vae_dir.name, tmp_path / "latents", SIZE, batch_size=8, num_workers=0,
                          device="cpu", progress=False)
    index = json.loads((out / "index.json").read_text())
    assert index["vae"] == str(vae_dir.absolute()) and index["image_size"] == SIZE


def test_a_full_disk_is_one_line_naming_the_shard_and_a_rerun_resumes(image_dir, vae_dir, tmp_path, load_script,
                                                                       monkeypatch, capsys):
    import errno
    import os

    out = tmp_path / "latents"
    argv = ["--data-dir", str(image_dir), "--vae", str(vae_dir), "--image-size", str(SIZE), "--output-dir", str(out),
            "--shard-size", "4", "--batch-size", "4", "--num-workers", "0", "--device", "cpu", "--quiet"]
    real = os.posix_fallocate
    calls = []

    def full_at_second_shard(fd, offset, length):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full_at_second_shard)
    capsys.readouterr()
    assert load_script("extract_latents").cli(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(r"error: No space left on device while writing .*\.latents\.partial/shard_00001\.tmp\.npy", err)
    partial = tmp_path / ".latents.partial"
    assert sorted(p.name for p in partial.iterdir()) == ["progress.json", "shard_00000.json", "shard_00000.npy"]
    monkeypatch.setattr(os, "posix_fallocate", real)
    assert load_script("extract_latents").cli(argv) == 0
    assert len(LatentDataset(out)) == 8 and sorted(p.name for p in tmp_path.iterdir()) == ["latents"]
