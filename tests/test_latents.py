"""The latent cache: the stored Gaussians equal on-the-fly encoding, sampled latents follow them,
an interrupted extraction resumes by shard, and the folder follows the output rules."""

import json
import os
import pickle
import shutil
import stat

import numpy as np
import pytest
import torch
from PIL import Image

import moh_dit.commands as commands
import moh_dit.data.latents as latents_mod
from moh_dit.data.datasets import CorruptImageError, ImageFolderDataset, flip_for
from moh_dit.data.latents import LatentDataset, encode_distribution, extract_latents, load_vae

pytestmark = pytest.mark.usefixtures("one_thread")
SIZE = 32  # the tiny VAE downsamples by 8: 4 x 4 latents
KW = dict(batch_size=2, shard_size=3, num_workers=0, device="cpu", progress=False)


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
        (root / cls).mkdir(parents=True)
        for i in range(3 if c else 2):
            h, w = rng.integers(36, 60, size=2)  # non-square and larger: the crop and resize both matter
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    return root


def run(*argv):
    assert commands.run("extract-latents", [str(a) for a in argv] + ["--debug"]) == 0


@pytest.fixture(scope="module")
def cache(vae_dir, image_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "latents"
    old = os.umask(0o022)
    try:
        run("--data-dir", image_dir, "--vae", vae_dir, "--image-size", SIZE, "--output-dir", out, "--batch-size", 2,
            "--shard-size", 3, "--num-workers", 0, "--device", "cpu")
    finally:
        os.umask(old)
    return out


def test_cache_layout_and_dataset(cache, image_dir, vae_dir):
    index = json.loads((cache / "index.json").read_text())
    images = ImageFolderDataset(image_dir, SIZE)
    assert index["num_samples"] == len(images) == 8 and index["latent_shape"] == [4, 4, 4]
    assert index["classes"] == ["bird", "cat", "dog"] and index["class_to_idx"] == images.class_to_idx
    assert index["scaling_factor"] == pytest.approx(0.18215) and index["vae"] == str(vae_dir)
    assert index["image_size"] == SIZE and [s["count"] for s in index["shards"]] == [3, 3, 2]
    assert json.loads((cache / "files.json").read_text()) == [os.path.relpath(p, image_dir) for p, _ in images.samples]
    shard = np.load(cache / "shard_00000.npy", mmap_mode="r")
    assert isinstance(shard, np.memmap) and shard.shape == (3, 2, 2, 4, 4, 4)
    assert sorted(p.name for p in cache.iterdir()) == [".moh-dit-output.json", "files.json", "index.json",
                                                       "labels.npy", "shard_00000.npy", "shard_00001.npy",
                                                       "shard_00002.npy"]
    assert sorted(p.name for p in cache.parent.iterdir()) == ["latents"]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in cache.iterdir())  # the umask's permissions

    ds = LatentDataset(cache)
    assert len(ds) == 8 and ds.num_classes == 3 and [ds[i][1] for i in range(8)] == images.targets
    latent, _ = ds[5]
    assert latent.shape == (4, 4, 4) and latent.dtype == torch.float32
    assert torch.equal(ds[(5, 2)][0], ds[(5, 2)][0]) and not torch.equal(ds[(5, 2)][0], ds[(5, 3)][0])
    assert len(pickle.dumps(ds)) < 10_000 and ds._shards is not None  # memory maps are not pickled into workers
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
        for epoch in range(3):  # the cache's flip is the image dataset's
            expected = encode_distribution(vae, images[(i, epoch)][0][None])[0][0] * 0.18215
            torch.testing.assert_close(means[(i, epoch)][0], expected, rtol=1e-5, atol=1e-5)
            assert torch.equal(means[(i, epoch)][0],
                               torch.from_numpy(means.stats(i, flip_for(11, epoch, i))[0] * np.float32(0.18215)))


def test_sampled_latents_follow_the_stored_distribution(cache):
    ds = LatentDataset(cache, random_flip=False, seed=0)
    mean, std = ds.stats(3, False)
    draws = torch.stack([ds[(3, epoch)][0] for epoch in range(3000)]).numpy()
    assert np.all(np.abs(draws.mean(0) - mean * 0.18215) < 5 * std * 0.18215 / np.sqrt(len(draws)))
    np.testing.assert_allclose(draws.std(0), std * 0.18215, rtol=0.1)


def test_corrupt_images_stop_or_are_skipped_and_a_failed_start_blocks_nothing(vae_dir, image_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(image_dir, data)
    (data / "bird" / "0_broken.png").write_bytes(b"not an image at all")
    out = tmp_path / "out"
    # The error crosses a DataLoader worker and names the file; a start that made no shard leaves nothing.
    with pytest.raises(CorruptImageError, match="0_broken.png"):
        extract_latents(data, vae_dir, out, SIZE, **{**KW, "num_workers": 1})
    assert not out.exists()
    extract_latents(data, vae_dir, out, SIZE, on_corrupt="skip", **KW)
    index = json.loads((out / "index.json").read_text())
    assert index["num_skipped"] == 1 and index["skipped"] == ["bird/0_broken.png"]
    assert [LatentDataset(out)[i][1] for i in range(8)] == ImageFolderDataset(image_dir, SIZE).targets


@pytest.mark.slow
def test_an_interrupted_extraction_resumes_by_shard(vae_dir, image_dir, tmp_path, monkeypatch):
    out, calls, real = tmp_path / "latents", [], latents_mod.encode_distribution

    def flaky(vae, images):
        calls.append(1)
        if len(calls) == 3:  # the first batch of the second shard (2 batches per shard)
            raise KeyboardInterrupt
        return real(vae, images)

    monkeypatch.setattr(latents_mod, "encode_distribution", flaky)
    kwargs = {**KW, "shard_size": 4}
    with pytest.raises(KeyboardInterrupt):
        extract_latents(image_dir, vae_dir, out, SIZE, **kwargs)
    assert {"shard_00000.npy", "shard_00000.json"} <= {p.name for p in out.iterdir()}
    assert not (out / "index.json").exists()
    with pytest.raises(FileExistsError) as error:  # other settings never mix with the unfinished cache
        extract_latents(image_dir, vae_dir, out, SIZE, **KW)
    assert error.value.filename == str(out)
    calls.clear()
    monkeypatch.setattr(latents_mod, "encode_distribution", lambda vae, images: calls.append(1) or real(vae, images))
    extract_latents(image_dir, vae_dir, out, SIZE, **kwargs)
    assert len(calls) == 2  # the second shard only
    whole = extract_latents(image_dir, vae_dir, tmp_path / "whole", SIZE, **kwargs)
    for k in range(2):
        np.testing.assert_array_equal(np.load(out / f"shard_0000{k}.npy"), np.load(whole / f"shard_0000{k}.npy"))
    extract_latents(image_dir, vae_dir, out, SIZE, overwrite=True, **{**kwargs, "dtype": "float16"})
    assert json.loads((out / "index.json").read_text())["dtype"] == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latents", "whole"]  # no scratch, no lock left


def test_the_output_is_never_a_users_folder_or_inside_an_input(vae_dir, image_dir, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError):
            extract_latents(image_dir, vae_dir, precious, SIZE, overwrite=overwrite, **KW)
    assert [p.name for p in precious.iterdir()] == ["thesis.tex"]
    for inside in (image_dir / "cache", vae_dir / "cache"):
        with pytest.raises(ValueError, match="overlap"):
            extract_latents(image_dir, vae_dir, inside, SIZE, **KW)
        assert not inside.exists()
    with pytest.raises(ValueError, match="36"):  # not a multiple of the VAE's downsampling
        extract_latents(image_dir, vae_dir, tmp_path / "o", 36, **KW)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"]


@pytest.mark.parametrize("flag, value", [("--num-workers", "10000"), ("--num-workers", "-1"), ("--image-size", "0"),
                                         ("--batch-size", "0"), ("--shard-size", "0"), ("--dtype", "bfloat16")])
def test_the_parser_refuses_bad_values(flag, value, tmp_path, refuses):
    refuses("extract-latents", ["--data-dir", "d", "--vae", "v", "--output-dir", tmp_path / "o", flag, value], flag,
            status=2)


def test_a_local_vae_is_recorded_by_its_absolute_path(image_dir, vae_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(vae_dir.parent)
    out = extract_latents(image_dir, vae_dir.name, tmp_path / "latents", SIZE, **{**KW, "shard_size": 8})
    assert json.loads((out / "index.json").read_text())["vae"] == str(vae_dir.absolute())
