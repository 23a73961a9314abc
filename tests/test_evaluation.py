"""Tests of moh_dit.evaluation and scripts/evaluate.py: offline, CPU, tiny inputs.

The Inception used here is the seeded random TF-compatible InceptionV3 written to a local
weights file, so nothing is downloaded; its numbers only check the plumbing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from moh_dit import evaluation as ev
from moh_dit.errors import InvalidInput

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# helpers and fixtures
# ---------------------------------------------------------------------------------------------


class TinyExtractor(nn.Module):
    """A cheap stand-in extractor returning the dict protocol; counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.proj = nn.Parameter(torch.randn(48, 5, generator=generator))
        self.calls = 0

    def forward(self, images: torch.Tensor) -> dict:
        self.calls += 1
        pooled = F.adaptive_avg_pool2d(images.float() / 255.0, 4).flatten(1)  # (N, 48)
        return {"pool": pooled, "logits": pooled @ self.proj, "spatial": pooled[:, :6]}


def _smooth_images(n: int, size: int, offset: int = 0) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size]
    images = [
        np.stack([(xx * 7 + 13 * (i + offset)) % 256, (yy * 5 + 29 * (i + offset)) % 256, (xx + yy + 40 * i) % 256], axis=-1)
        for i in range(n)
    ]
    return np.asarray(images, dtype=np.uint8)  # (n, size, size, 3)


def _noise_images(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _write_pngs(folder: Path, images: np.ndarray) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(images):
        # two levels so the recursive, relative-path-sorted listing is exercised
        path = folder / f"part{i // 4}" / f"{i:03d}.png"
        path.parent.mkdir(exist_ok=True)
        Image.fromarray(image).save(path)
        paths.append(path)
    return paths


def _random_spd(rng: np.random.Generator, d: int) -> np.ndarray:
    a = rng.standard_normal((d, 2 * d))
    return a @ a.T / (2 * d) + 0.1 * np.eye(d)


def _fid_with_sqrtm(mu1, s1, mu2, s2) -> float:
    covmean = scipy.linalg.sqrtm(s1 @ s2)
    covmean = np.real(covmean)
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


@pytest.fixture(scope="module")
def random_weights(tmp_path_factory) -> Path:
    return ev.save_random_inception_weights(tmp_path_factory.mktemp("weights") / "random-inception.pth", seed=0)


@pytest.fixture(scope="module")
def random_inception(random_weights) -> ev.TFInceptionV3Features:
    return ev.TFInceptionV3Features.from_file(random_weights)


@pytest.fixture(scope="module")
def evaluate_script(load_script):
    return load_script("evaluate")


@pytest.fixture
def no_weights_anywhere(tmp_path, monkeypatch) -> Path:
    """No env variable, an empty torch hub dir; returns where the hub file would be."""
    monkeypatch.delenv(ev.INCEPTION_WEIGHTS_ENV, raising=False)
    hub = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    return hub / "checkpoints" / ev.INCEPTION_WEIGHTS_NAME


@pytest.fixture(autouse=True)
def cache_outside_home(tmp_path_factory, monkeypatch) -> Path:
    """The package's cache folder ($MOH_DIT_CACHE) in a temporary folder: no test here writes
    reference statistics into the home folder, even one that forgets --cache-dir."""
    root = tmp_path_factory.mktemp("moh-dit-cache")
    monkeypatch.setenv(ev.CACHE_ENV, str(root))
    return root


@pytest.fixture
def info_log():
    """The package's log level at info (as the commands set it) for one test, then as it was."""
    from moh_dit.utils.logging import get_verbosity, set_verbosity

    before = get_verbosity()
    set_verbosity("info")
    yield
    set_verbosity(before)


class FakeResponse:
    """What ``urllib.request.urlopen`` returns, serving ``chunks`` to ``read`` and then EOF."""

    def __init__(self, chunks):
        self.data = iter([*chunks, b""])

    def read(self, n):
        return next(self.data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------------
# Frechet distance and statistics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_frechet_distance_matches_scipy_sqrtm(seed):
    rng = np.random.default_rng(seed)
    d = 24
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    s1, s2 = _random_spd(rng, d), _random_spd(rng, d)
    assert ev.frechet_distance(mu1, s1, mu2, s2) == pytest.approx(_fid_with_sqrtm(mu1, s1, mu2, s2), abs=1e-6)


def test_frechet_distance_diagonal_closed_form():
    mu1, mu2 = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0])
    v1, v2 = np.array([1.0, 4.0, 0.25]), np.array([4.0, 1.0, 1.0])
    expected = 1.0 + 0.0 + 4.0 + np.sum(v1 + v2 - 2 * np.sqrt(v1 * v2))  # = 5 + 1 + 1 + 0.25
    assert ev.frechet_distance(mu1, np.diag(v1), mu2, np.diag(v2)) == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(7.25)


def test_frechet_distance_of_a_set_with_itself_is_zero():
    rng = np.random.default_rng(0)
    full_rank = ev.compute_statistics(rng.standard_normal((200, 8)))
    assert abs(full_rank.frechet_distance(full_rank)) < 1e-10
    # N < D gives a singular covariance, as in small tests; clipped eigenvalues keep it ~0
    singular = ev.compute_statistics(rng.standard_normal((10, 50)))
    assert abs(singular.frechet_distance(singular)) < 1e-10 * np.trace(singular.sigma)


@pytest.mark.parametrize("n1, n2, d", [(6, 9, 40), (60, 45, 8)])
def test_frechet_distance_from_features_matches_covariance_route(n1, n2, d):
    rng = np.random.default_rng(n1)
    x1, x2 = rng.standard_normal((n1, d)), rng.standard_normal((n2, d)) * 1.5 + 0.3
    expected = ev.compute_statistics(x1).frechet_distance(ev.compute_statistics(x2))
    assert ev.frechet_distance_from_features(x1, x2) == pytest.approx(expected, rel=1e-9)
    assert abs(ev.frechet_distance_from_features(x1, x1)) < 1e-10 * d
    with pytest.raises(ValueError, match="widths differ"):
        ev.frechet_distance_from_features(x1, x2[:, :-1])


def test_frechet_distance_rejects_bad_shapes():
    mu, sigma = np.zeros(3), np.eye(3)
    with pytest.raises(ValueError, match="different lengths"):
        ev.frechet_distance(mu, sigma, np.zeros(4), np.eye(4))
    with pytest.raises(ValueError, match=r"sigma2 must have shape \(3, 3\)"):
        ev.frechet_distance(mu, sigma, mu, np.eye(4))
    with pytest.raises(ValueError, match="1-D"):
        ev.frechet_distance(np.zeros((3, 1)), sigma, mu, sigma)
    with pytest.raises(ValueError, match="not symmetric"):
        ev.frechet_distance(mu, sigma, mu, np.triu(np.ones((3, 3))))


def test_statistics_are_float64_and_unbiased():
    stats = ev.compute_statistics(np.array([[0.0, 1.0], [2.0, 1.0]], dtype=np.float32))
    assert stats.mu.dtype == np.float64 and stats.sigma.dtype == np.float64
    np.testing.assert_allclose(stats.mu, [1.0, 1.0])
    np.testing.assert_allclose(stats.sigma, [[2.0, 0.0], [0.0, 0.0]])  # divides by N - 1
    with pytest.raises(ValueError, match="at least 2"):
        ev.compute_statistics(np.zeros((1, 3)))


# ---------------------------------------------------------------------------------------------
# Inception Score
# ---------------------------------------------------------------------------------------------


def test_inception_score_hand_cases():
    assert ev.inception_score(np.full((10, 7), 1 / 7)) == pytest.approx(1.0)
    assert ev.inception_score(np.eye(6)) == pytest.approx(6.0)


def test_inception_score_splits_in_order_like_adm():
    a, b = [1.0, 0.0], [0.0, 1.0]
    # splits of 2 taken in order: each split of [a, a], [b, b] is one class -> 1
    assert ev.inception_score(np.array([a, a, b, b]), split_size=2) == pytest.approx(1.0)
    assert ev.inception_score(np.array([a, b, a, b]), split_size=2) == pytest.approx(2.0)
    assert ev.inception_score(np.array([a, a, b, b]), split_size=5000) == pytest.approx(2.0)  # one split
    # a shorter last split is kept, as ADM: (2 + 2 + 1) / 3
    assert ev.inception_score(np.array([a, b, a, b, a]), split_size=2) == pytest.approx(5 / 3)


def test_inception_score_from_logits_matches_probabilities():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(9), size=12)
    assert ev.inception_score_from_logits(np.log(probs) + 3.0) == pytest.approx(ev.inception_score(probs), rel=1e-10)
    with pytest.raises(ValueError, match="inception_score_from_logits"):
        ev.inception_score(np.log(probs))


# ---------------------------------------------------------------------------------------------
# Precision and recall
# ---------------------------------------------------------------------------------------------


def test_manifold_radii_exclude_the_point_itself():
    points = np.array([[0.0], [1.0], [3.0], [6.0], [10.0]])
    radii = ev.manifold_radii_squared(points, k=1, batch_size=2)
    np.testing.assert_array_equal(radii.numpy(), [1.0, 1.0, 4.0, 9.0, 16.0])
    with pytest.raises(ValueError, match="more than k=3"):
        ev.manifold_radii_squared(points[:3], k=3)


@pytest.mark.parametrize("adm_float16", [True, False])
def test_precision_recall_hand_case(adm_float16):
    # reference: 0, 10, ..., 90 -> 3-NN radii 30 at the ends, 20 inside.
    reference = np.arange(0, 100, 10, dtype=np.float32)[:, None]
    # samples: a tight cluster near 45 (inside), -30 exactly on ref 0's boundary (inside, `<=`),
    # a far cluster (outside). Sample radii: -30 -> 76 (covers refs 0..40), 47 -> 3 (touches
    # ref 50 exactly), 44/45/46 -> 3/2/2 (touch nothing), far cluster -> 20/30 (nothing).
    samples = np.array([-30, 44, 45, 46, 47, 200, 210, 220, 230], dtype=np.float32)[:, None]
    precision, recall = ev.precision_recall(reference, samples, k=3, batch_size=4, adm_float16=adm_float16)
    assert precision == pytest.approx(5 / 9)
    assert recall == pytest.approx(6 / 10)


def test_precision_recall_matches_brute_force():
    rng = np.random.default_rng(0)
    reference = rng.standard_normal((23, 5))
    samples = rng.standard_normal((31, 5)) + 1.0

    def radii(x):
        d = ((x[:, None] - x[None]) ** 2).sum(-1)
        return np.sort(d, axis=1)[:, 3]

    d = ((reference[:, None] - samples[None]) ** 2).sum(-1)  # (23, 31)
    expected_precision = np.mean((d <= radii(reference)[:, None]).any(axis=0))
    expected_recall = np.mean((d <= radii(samples)[None, :]).any(axis=1))
    assert 0 < expected_precision < 1 and 0 < expected_recall < 1
    precision, recall = ev.precision_recall(reference, samples, batch_size=7, adm_float16=False)
    assert (precision, recall) == pytest.approx((expected_precision, expected_recall))
    blocked = ev.manifold_radii_squared(samples, batch_size=5, adm_float16=False)
    np.testing.assert_allclose(blocked.numpy(), radii(samples), rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Feature extractor: TF-compatible InceptionV3 layers, random weights, weights lookup
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sfid_features_are_mixed_6d_branch1x1_first_7_channels_hwc(random_inception):
    from torch_fidelity.interpolate_compat_tensorflow import interpolate_bilinear_2d_like_tensorflow1x

    images = torch.from_numpy(_noise_images(2, 40)).permute(0, 3, 1, 2).contiguous()  # (2, 3, 40, 40)
    features = random_inception(images)
    model = random_inception.inception
    with torch.no_grad():
        x = interpolate_bilinear_2d_like_tensorflow1x(images.float(), size=(299, 299), align_corners=False)
        x = (x - 128) / 128
        for name in ["Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "MaxPool_1", "Conv2d_3b_1x1",
                     "Conv2d_4a_3x3", "MaxPool_2", "Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a",
                     "Mixed_6b", "Mixed_6c"]:  # fmt: skip
            x = getattr(model, name)(x)
        branch = model.Mixed_6d.branch1x1(x)  # (2, 192, 17, 17)
    assert branch.shape == (2, 192, 17, 17)
    assert features.spatial.shape == (2, 2023) == (2, random_inception.spatial_dim)
    first7 = branch[:, :7]
    assert (first7 > 0).sum() > 50 and (branch[:, 7:] > 0).any()  # post-ReLU, enough non-zeros to tell orders apart
    torch.testing.assert_close(features.spatial, first7.permute(0, 2, 3, 1).reshape(2, -1))
    # pin the order by hand at the largest activation (n, c, h, w): it sits at (h * 17 + w) * 7 + c
    n, c, h, w = np.unravel_index(int(first7.argmax()), first7.shape)
    assert features.spatial[n, (h * 17 + w) * 7 + c] == first7.max() > 0
    assert features.pool.shape == (2, 2048) and features.logits.shape == (2, 1008)


@pytest.mark.slow
def test_random_inception_file_loads_through_the_standard_code_path(random_weights, random_inception):
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    images = torch.from_numpy(_smooth_images(2, 24)).permute(0, 3, 1, 2).contiguous()
    plain = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(random_weights))
    (pool,) = plain(images)
    torch.testing.assert_close(random_inception(images).pool, pool)
    assert not random_inception.comparable_to_published
    assert random_inception.weights_info["sha256"].startswith(random_inception.identity.split("sha256=")[1])
    # the in-memory builder gives the same seeded weights as the file, and says it is random
    in_memory = ev.build_random_inception(seed=0)
    reference = plain.state_dict()
    assert all(torch.equal(value, reference[name]) for name, value in in_memory.inception.state_dict().items())
    assert "RANDOM" in in_memory.identity and not in_memory.comparable_to_published
    # Kaiming-normal, not PyTorch's default: std sqrt(2 / fan_in)
    assert plain.Mixed_6d.branch1x1.conv.weight.std().item() == pytest.approx((2 / 768) ** 0.5, rel=0.05)


def test_tf32_disabled_restores_settings():
    matmul, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    if hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision"):  # torch >= 2.9
        owners, attribute, on, off = (matmul, conv), "fp32_precision", "tf32", "ieee"
    else:
        owners, attribute, on, off = (matmul, torch.backends.cudnn), "allow_tf32", True, False
    before = [getattr(owner, attribute) for owner in owners]
    try:
        for owner in owners:
            setattr(owner, attribute, on)
        with pytest.raises(RuntimeError, match="restored"), ev.tf32_disabled():
            assert [getattr(owner, attribute) for owner in owners] == [off, off]
            raise RuntimeError("restored even on errors")
        assert [getattr(owner, attribute) for owner in owners] == [on, on]
    finally:
        for owner, value in zip(owners, before):
            setattr(owner, attribute, value)


def test_weights_lookup_order(tmp_path, monkeypatch, no_weights_anywhere):
    explicit, from_env = tmp_path / "explicit.pth", tmp_path / "env.pth"
    explicit.write_bytes(b"x")
    from_env.write_bytes(b"x")
    no_weights_anywhere.parent.mkdir(parents=True)
    no_weights_anywhere.write_bytes(b"x")
    assert ev.resolve_inception_weights(download=False) == no_weights_anywhere  # hub cache
    monkeypatch.setenv(ev.INCEPTION_WEIGHTS_ENV, str(from_env))
    assert ev.resolve_inception_weights(download=False) == from_env
    assert ev.resolve_inception_weights(explicit, download=False) == explicit
    with pytest.raises(ev.InceptionWeightsNotFoundError, match="missing.pth") as error:
        ev.resolve_inception_weights(tmp_path / "missing.pth")
    assert error.value.parameters == ("inception_weights",)
    monkeypatch.setenv(ev.INCEPTION_WEIGHTS_ENV, str(tmp_path / "missing.pth"))
    with pytest.raises(ev.InceptionWeightsNotFoundError, match=ev.INCEPTION_WEIGHTS_ENV):
        ev.resolve_inception_weights(download=False)


def test_missing_weights_error_says_where_and_how(no_weights_anywhere, monkeypatch):
    with pytest.raises(FileNotFoundError) as info:
        ev.resolve_inception_weights(download=False)
    message = str(info.value)
    assert isinstance(info.value, ev.InceptionWeightsNotFoundError)
    for needle in (str(no_weights_anywhere), ev.INCEPTION_WEIGHTS_URL, ev.INCEPTION_WEIGHTS_ENV):
        assert needle in message
    assert info.value.parameters == ("inception_weights",)  # the third way: give the file

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(ev.InceptionWeightsNotFoundError, match="download failed.*unreachable"):
        ev.resolve_inception_weights(download=True, timeout=0.1)

    # a download that completes with the wrong content (e.g. a proxy page)
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: FakeResponse([b"<html>not the weights</html>"]))
    with pytest.raises(ev.InceptionWeightsNotFoundError, match="SHA-256"):
        ev.resolve_inception_weights(download=True)
    assert not no_weights_anywhere.exists() and list(no_weights_anywhere.parent.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Image sources
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compressed", [False, True])
def test_streaming_npz_reader_matches_np_load(tmp_path, compressed):
    images = _noise_images(7, 5)
    path = tmp_path / "samples.npz"
    (np.savez_compressed if compressed else np.savez)(path, arr_0=images, other=np.arange(3))
    expected_type = zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED
    assert zipfile.ZipFile(path).getinfo("arr_0.npy").compress_type == expected_type
    reader = ev.NpzArrayReader(path)
    assert (reader.shape, reader.dtype, len(reader)) == ((7, 5, 5, 3), np.uint8, 7)
    batches = list(reader.iter_batches(3))
    assert [len(b) for b in batches] == [3, 3, 1]
    np.testing.assert_array_equal(np.concatenate(batches), np.load(path)["arr_0"])
    np.testing.assert_array_equal(np.concatenate(list(reader.iter_batches(100))), images)  # re-iterable


def test_streaming_npz_reader_reports_corrupt_data(tmp_path):
    images = _noise_images(4, 64)  # larger than zipfile's read-ahead: the CRC fails mid-stream
    path = _save(tmp_path / "samples.npz", arr_0=images)
    data = bytearray(path.read_bytes())
    at = data.find(images.tobytes()[:64])
    data[at + 100] ^= 0xFF  # one flipped byte inside the stored array: caught by the zip CRC
    path.write_bytes(bytes(data))
    reader = ev.NpzArrayReader(path)
    with pytest.raises(ValueError, match="corrupt at image"):
        list(reader.iter_batches(3))


def test_npz_and_array_inputs_are_validated(tmp_path):
    with pytest.raises(ValueError, match=r"no array 'arr_0' \(arrays: \['x'\]\)"):
        ev.NpzArrayReader(_save(tmp_path / "a.npz", x=np.zeros(3)))
    (tmp_path / "garbage.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="neither a folder of images nor an .npz"):
        ev.open_image_source(tmp_path / "garbage.npz")
    with pytest.raises(ValueError, match="not a valid .npz"):
        ev.NpzArrayReader(tmp_path / "garbage.npz")
    with pytest.raises(ValueError, match="must be uint8.*float32"):
        ev.open_image_source(_save(tmp_path / "f.npz", arr_0=np.zeros((2, 4, 4, 3), np.float32)))
    with pytest.raises(ValueError, match="looks like NCHW"):
        ev.open_image_source(_save(tmp_path / "c.npz", arr_0=np.zeros((2, 3, 4, 4), np.uint8)))
    with pytest.raises(ValueError, match="square"):
        ev.open_image_source(np.zeros((2, 4, 6, 3), np.uint8))
    with pytest.raises(FileNotFoundError, match="no such file"):
        ev.open_image_source(tmp_path / "missing.npz")


def _save(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def test_folder_source_is_recursive_sorted_and_validated(tmp_path):
    folder = tmp_path / "images"
    for name, value in [("b.png", 2), ("a/c.png", 1), ("a.png", 0)]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((6, 6), value * 50, np.uint8)).save(folder / name)  # grayscale -> RGB
    (folder / "notes.txt").write_text("ignored")
    source = ev.open_image_source(folder)
    assert (source.num_images, source.resolution) == (3, 6)
    (batch,) = list(source.batches(8))
    assert batch.shape == (3, 6, 6, 3) and batch.dtype == torch.uint8
    assert batch[:, 0, 0, :].tolist() == [[0] * 3, [50] * 3, [100] * 3]  # a.png < a/c.png < b.png
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(folder / "z.png")
    with pytest.raises(ValueError, match="same size"):
        ev.open_image_source(folder)
    Image.fromarray(np.zeros((8, 6, 3), np.uint8)).save(folder / "z.png")
    with pytest.raises(ValueError, match="square"):
        ev.open_image_source(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images"):
        ev.open_image_source(tmp_path / "empty")


# ---------------------------------------------------------------------------------------------
# References, cache and the whole evaluation
# ---------------------------------------------------------------------------------------------


def test_reference_statistics_cache_is_reused_and_invalidated(tmp_path):
    paths = _write_pngs(tmp_path / "ref", _smooth_images(8, 16))
    cache = tmp_path / "cache"
    extractor = TinyExtractor()
    first = ev.load_reference(tmp_path / "ref", extractor, batch_size=3, cache_dir=cache)
    calls = extractor.calls
    assert not first.from_cache and calls == 3
    second = ev.load_reference(tmp_path / "ref", extractor, batch_size=3, cache_dir=cache)
    assert second.from_cache and extractor.calls == calls
    np.testing.assert_array_equal(second.pool.sigma, first.pool.sigma)
    np.testing.assert_array_equal(second.pool_features, first.pool_features)
    assert [p.suffix for p in cache.iterdir()] == [".npz"]  # no temp files left behind

    # other weights -> other identity -> recomputed
    other = TinyExtractor()
    with torch.no_grad():
        other.proj.add_(1.0)
    assert not ev.load_reference(tmp_path / "ref", other, cache_dir=cache).from_cache
    # a changed image -> recomputed, with different statistics
    Image.fromarray(_noise_images(1, 16)[0]).save(paths[0])
    os.utime(paths[0], ns=(1, 1))
    third = ev.load_reference(tmp_path / "ref", extractor, batch_size=3, cache_dir=cache)
    assert not third.from_cache and not np.allclose(third.pool.mu, first.pool.mu)


def test_reference_cache_folder_is_the_documented_one(tmp_path, monkeypatch):
    monkeypatch.setenv(ev.CACHE_ENV, str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ev.reference_cache_dir() == tmp_path / "mine" / "reference_stats"
    monkeypatch.delenv(ev.CACHE_ENV)
    assert ev.reference_cache_dir() == tmp_path / "xdg" / "moh-dit" / "reference_stats"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ev.reference_cache_dir() == tmp_path / "home" / ".cache" / "moh-dit" / "reference_stats"
    assert "MOH_DIT_CACHE" in (ROOT / "docs" / "evaluation.md").read_text()


def test_reference_cache_is_written_where_the_variable_says_and_announced(tmp_path, cache_outside_home,
                                                                          info_log, capsys):
    _write_pngs(tmp_path / "ref", _smooth_images(6, 16))
    extractor = TinyExtractor()
    first = ev.load_reference(tmp_path / "ref", extractor)
    written = list((cache_outside_home / "reference_stats").iterdir())
    assert not first.from_cache and [p.suffix for p in written] == [".npz"]
    out = capsys.readouterr().out
    assert f"wrote the reference statistics cache {written[0]} (" in out and " kB)" in out
    assert ev.load_reference(tmp_path / "ref", extractor).from_cache
    assert f"read from the cache {written[0]}" in capsys.readouterr().out
    # use_cache=False neither reads the cache nor writes one
    calls = extractor.calls
    assert not ev.load_reference(tmp_path / "ref", extractor, use_cache=False).from_cache
    assert extractor.calls > calls
    written[0].unlink()
    ev.evaluate(_noise_images(4, 16), tmp_path / "ref", extractor=extractor, use_cache=False)
    assert not any((cache_outside_home / "reference_stats").iterdir()) and "cache" not in capsys.readouterr().out


def test_evaluate_script_random_inception_flag(tmp_path, evaluate_script, cache_outside_home, monkeypatch, capsys):
    """The flag's plumbing, with a cheap stand-in for the random Inception (the real one: the slow test below)."""
    built = []
    monkeypatch.setattr(ev, "build_random_inception", lambda seed: built.append(seed) or TinyExtractor())
    _write_pngs(tmp_path / "ref", _smooth_images(5, 16))
    _write_pngs(tmp_path / "samples", _noise_images(5, 16))
    out = tmp_path / "metrics.json"
    argv = ["--samples", tmp_path / "samples", "--ref", tmp_path / "ref", "--random-inception-seed", "3",
            "--device", "cpu", "--num-workers", "0", "--output", out]  # fmt: skip
    assert evaluate_script.cli([str(a) for a in argv]) == 0
    printed = capsys.readouterr()
    assert built == [3] and "random InceptionV3 (seed 3)" in printed.err and "NOT comparable" in printed.err
    payload = json.loads(out.read_text())
    assert payload["comparable_to_published"] is False and "not comparable" in " ".join(payload["notes"])
    cache = cache_outside_home / "reference_stats"
    (cached,) = cache.iterdir()
    assert f"wrote the reference statistics cache {cached}" in printed.out
    before = cached.stat().st_mtime_ns
    assert evaluate_script.cli([str(a) for a in argv] + ["--no-cache"]) == 0
    assert not json.loads(out.read_text())["reference_from_cache"]
    assert list(cache.iterdir()) == [cached] and cached.stat().st_mtime_ns == before


def test_evaluate_script_refuses_bad_random_inception_flags(tmp_path, evaluate_inputs, refuses):
    flags = {k: v for k, v in evaluate_inputs.items() if k != "--inception-weights"}
    argv = [item for pair in flags.items() for item in pair]
    refuses("evaluate", [*argv, "--random-inception-seed", "-1"], r"--random-inception-seed .*got -1")
    refuses("evaluate", [*argv, "--random-inception-seed", "0", "--inception-weights", evaluate_inputs[
        "--inception-weights"]], "not allowed with argument", status=2)
    with pytest.raises(InvalidInput) as error:
        ev.evaluate(tmp_path / "samples", tmp_path / "ref", extractor=TinyExtractor(), random_inception_seed=0)
    assert error.value.parameters == ("extractor", "random_inception_seed")
    with pytest.raises(InvalidInput, match=str(2**64)) as error:
        ev.evaluate(tmp_path / "samples", tmp_path / "ref", random_inception_seed=2**64)
    assert error.value.parameters == ("random_inception_seed",)


@pytest.mark.slow
def test_evaluate_script_end_to_end_with_a_random_inception(tmp_path, random_weights, evaluate_script, capsys):
    """Offline, no weights file: the same features as the seed's weights file, marked not comparable."""
    _write_pngs(tmp_path / "ref", _smooth_images(6, 16))
    _save(tmp_path / "samples.npz", arr_0=_noise_images(6, 32)[:, 8:24, 8:24])
    common = ["--samples", tmp_path / "samples.npz", "--ref", tmp_path / "ref", "--device", "cpu",
              "--num-workers", "0", "--batch-size", "6", "--no-cache", "--no-download"]  # fmt: skip
    out = tmp_path / "random.json"
    assert evaluate_script.cli([str(a) for a in [*common, "--random-inception-seed", "0", "--output", out]]) == 0
    assert "NOT comparable to published numbers" in capsys.readouterr().err
    payload = json.loads(out.read_text())
    assert payload["comparable_to_published"] is False and "RANDOM-kaiming-seed=0" in payload["extractor"]
    assert "not comparable" in " ".join(payload["notes"]) and payload["num_samples"] == 6
    for key in ("fid", "sfid", "inception_score", "precision", "recall"):
        assert np.isfinite(payload[key])
    assert payload["fid"] > 0
    from_file = evaluate_script.main(evaluate_script.parse_args(
        [str(a) for a in [*common, "--inception-weights", random_weights]]))
    assert from_file["fid"] == pytest.approx(payload["fid"], rel=1e-9)


def test_adm_reference_batch_uses_stored_statistics(tmp_path):
    images = _smooth_images(10, 16)
    extractor = TinyExtractor()
    features = ev.extract_features(images, extractor, batch_size=4)
    pool, spatial = ev.compute_statistics(features.pool), ev.compute_statistics(features.spatial)
    ref = _save(tmp_path / "ref.npz", arr_0=images, mu=pool.mu, sigma=pool.sigma, mu_s=spatial.mu, sigma_s=spatial.sigma)
    result = ev.evaluate(images, ref, extractor=extractor, batch_size=4, cache_dir=tmp_path / "cache")
    assert abs(result.fid) < 1e-9 and abs(result.sfid) < 1e-9
    assert (result.precision, result.recall) == (1.0, 1.0)
    assert result.num_reference_images == 10 and not result.comparable_to_published

    # FID/sFID come from the stored mu/sigma, not from arr_0: shift the stored mean by 1 in
    # each of the 48 pool dimensions and FID becomes 48 while precision/recall stay 1.
    shifted = _save(
        tmp_path / "shifted.npz", arr_0=images, mu=pool.mu + 1, sigma=pool.sigma, mu_s=spatial.mu, sigma_s=spatial.sigma
    )
    batches = iter([images[:6], torch.from_numpy(images[6:])])  # samples straight from an iterator
    result = ev.evaluate(batches, shifted, extractor=extractor, batch_size=4, use_cache=False)
    assert result.fid == pytest.approx(48.0) and abs(result.sfid) < 1e-9
    assert (result.precision, result.recall, result.num_samples) == (1.0, 1.0, 10)


@pytest.mark.slow
def test_evaluate_script_end_to_end(tmp_path, random_weights, evaluate_script):
    reference = _smooth_images(10, 32)
    _write_pngs(tmp_path / "ref", reference)
    _write_pngs(tmp_path / "samples", _noise_images(10, 32))
    common = ["--ref", str(tmp_path / "ref"), "--inception-weights", str(random_weights), "--batch-size", "5",
              "--device", "cpu", "--num-workers", "0", "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    out = tmp_path / "out" / "metrics.json"
    out.parent.mkdir()
    args = evaluate_script.parse_args(["--samples", str(tmp_path / "samples"), "--output", str(out), *common])
    payload = evaluate_script.main(args)
    assert json.loads(out.read_text()) == payload
    for key in ("fid", "sfid", "inception_score", "precision", "recall"):
        assert isinstance(payload[key], float) and np.isfinite(payload[key])
    assert payload["fid"] > 1.0 and payload["sfid"] > 0.0 and payload["inception_score"] >= 1.0
    assert payload["num_samples"] == payload["num_reference_images"] == 10
    assert payload["inception_weights"]["name"] == random_weights.name
    assert payload["comparable_to_published"] is False and "not comparable" in " ".join(payload["notes"])
    assert not payload["reference_from_cache"]

    # the same images as an ADM-style sample .npz: same features as the folder -> FID ~ 0
    samples_npz = _save(tmp_path / "samples.npz", arr_0=reference)
    again = evaluate_script.main(evaluate_script.parse_args(["--samples", str(samples_npz), *common]))
    assert again["reference_from_cache"]
    assert abs(again["fid"]) < 1e-4 * payload["fid"] and abs(again["sfid"]) < 1e-4 * payload["sfid"]
    assert (again["precision"], again["recall"]) == (1.0, 1.0)


def test_evaluate_script_fails_early_with_clear_errors(
    tmp_path, random_weights, evaluate_script, no_weights_anywhere, capsys
):
    _write_pngs(tmp_path / "ref", _smooth_images(4, 16))
    out = tmp_path / "metrics.json"
    base = ["--ref", str(tmp_path / "ref"), "--output", str(out), "--device", "cpu", "--num-workers", "0"]
    weights = ["--inception-weights", str(random_weights)]

    assert evaluate_script.cli(["--samples", str(tmp_path / "missing.npz"), *weights, *base]) == 1
    assert "missing.npz" in capsys.readouterr().err
    (tmp_path / "bad.npz").write_bytes(b"truncated")
    assert evaluate_script.cli(["--samples", str(tmp_path / "bad.npz"), *weights, *base]) == 1
    assert "bad.npz" in capsys.readouterr().err
    # valid inputs, no weights anywhere and no download: says where to put the file
    assert evaluate_script.cli(["--samples", str(tmp_path / "ref"), "--no-download", *base]) == 1
    err = capsys.readouterr().err
    assert ev.INCEPTION_WEIGHTS_URL in err and str(no_weights_anywhere) in err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# Images keep their values; folders are scanned once
# ---------------------------------------------------------------------------------------------


def test_folder_source_reads_16bit_images_by_their_range(tmp_path):
    """Reproduction: 16-bit PNGs were evaluated as white (convert("RGB") clips values above 255)."""
    folder = tmp_path / "images"
    folder.mkdir()
    for i, value in enumerate([0, 32768, 65535]):
        Image.fromarray(np.full((6, 6), value, np.uint16)).save(folder / f"{i}.png")
    (batch,) = list(ev.open_image_source(folder).batches(8))
    assert batch[:, 0, 0, :].tolist() == [[0] * 3, [128] * 3, [255] * 3]


def test_folder_source_does_not_follow_a_link_loop(tmp_path):
    folder = tmp_path / "images"
    _write_pngs(folder, _smooth_images(5, 8))
    (folder / "part0" / "loop").symlink_to("..", target_is_directory=True)
    _write_pngs(tmp_path / "elsewhere", _smooth_images(2, 8, offset=9))
    (folder / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)  # followed: outside the tree
    source = ev.open_image_source(folder)
    assert source.num_images == 7
    assert [p.relative_to(folder).as_posix() for p in source.files] == [
        "linked/part0/000.png", "linked/part0/001.png", *[f"part0/{i:03d}.png" for i in range(4)], "part1/004.png"
    ]


# ---------------------------------------------------------------------------------------------
# Evaluation refuses what cannot be compared
# ---------------------------------------------------------------------------------------------


class CountingSource(ev.ImageSource):
    """In-memory samples that count how many batches were read."""

    def __init__(self, images: np.ndarray) -> None:
        self.images = torch.from_numpy(images)
        self.num_images, self.resolution = images.shape[0], images.shape[1]
        self.description = "<counting source>"
        self.batches_read = 0

    def batches(self, batch_size: int, num_workers: int = 0):
        for batch in self.images.split(batch_size):
            self.batches_read += 1
            yield batch


def _adm_reference(path: Path, images: np.ndarray | None, dim: int = 48, spatial_dim: int = 6, **override) -> Path:
    arrays = {"mu": np.zeros(dim), "sigma": np.eye(dim), "mu_s": np.zeros(spatial_dim), "sigma_s": np.eye(spatial_dim)}
    if images is not None:
        arrays["arr_0"] = images
    arrays.update(override)
    return _save(path, **{k: v for k, v in arrays.items() if v is not None})


@pytest.mark.parametrize(
    "override, match",
    [
        ({"sigma": np.eye(47)}, r"'sigma' has shape \(47, 47\) but should be \(48, 48\)"),
        ({"sigma": np.zeros(48)}, r"'sigma' has shape \(48,\)"),
        ({"mu": np.zeros((48, 1))}, r"'mu' has shape \(48, 1\); expected a mean vector"),
        ({"sigma_s": np.eye(5)}, r"'sigma_s' has shape \(5, 5\) but should be \(6, 6\)"),
        ({"sigma_s": None}, r"has 'mu_s' but no 'sigma_s'"),
        ({"sigma": np.full((48, 48), np.nan)}, "NaN"),
        ({"sigma": np.triu(np.ones((48, 48)))}, "'sigma' is not symmetric"),
        # Reproduction: sigma = -ones gave "fid": -1915.0; a covariance has no negative eigenvalue.
        ({"sigma": -np.ones((48, 48))}, r"'sigma' is not a covariance matrix: it has a negative eigenvalue \(-48"),
        ({"sigma_s": -np.eye(6)}, r"'sigma_s' is not a covariance matrix"),
    ],
)
def test_bad_reference_statistics_are_refused_before_any_feature(tmp_path, override, match):
    """Reproduction: a reference whose sigma has the wrong shape was found only after all features."""
    ref = _adm_reference(tmp_path / "ref.npz", _smooth_images(6, 16), **override)
    samples = CountingSource(_noise_images(6, 16))
    extractor = TinyExtractor()
    with pytest.raises(ValueError, match=match):
        ev.evaluate(samples, ref, extractor=extractor, batch_size=2, cache_dir=tmp_path / "cache")
    assert samples.batches_read == 0 and extractor.calls == 0
    assert not (tmp_path / "cache").exists()


def test_stored_statistics_are_checked_against_the_inception_width(tmp_path, random_inception):
    # mu has the 2048 values of pool_3, sigma does not: refused before the reference or sample images are read
    ref = _adm_reference(tmp_path / "ref.npz", _smooth_images(4, 16), dim=2048, spatial_dim=2023, sigma=np.eye(16))
    samples = CountingSource(_noise_images(4, 16))
    with pytest.raises(ValueError, match=r"'sigma' has shape \(16, 16\) but should be \(2048, 2048\)"):
        ev.evaluate(samples, ref, extractor=random_inception, use_cache=False)
    assert samples.batches_read == 0
    small = _adm_reference(tmp_path / "small.npz", None, dim=48, spatial_dim=2023)
    with pytest.raises(ValueError, match=r"'mu' has shape \(48,\) but should be \(2048,\)"):
        ev.evaluate(samples, small, extractor=random_inception, use_cache=False)
    assert samples.batches_read == 0


def test_reference_statistics_object_is_checked_too(tmp_path):
    extractor = TinyExtractor()
    ref = ev.load_reference(_write_pngs(tmp_path / "ref", _smooth_images(5, 16))[0].parents[1], extractor, use_cache=False)
    calls = extractor.calls
    broken = dataclasses.replace(ref, pool=ev.FeatureStatistics(ref.pool.mu, ref.pool.sigma[:-1]))
    samples = CountingSource(_noise_images(5, 16))
    with pytest.raises(ValueError, match=r"'sigma' has shape \(47, 48\)"):
        ev.evaluate(samples, broken, extractor=extractor)
    assert samples.batches_read == 0 and extractor.calls == calls


def test_cached_statistics_of_the_wrong_shape_are_recomputed(tmp_path):
    _write_pngs(tmp_path / "ref", _smooth_images(6, 16))
    cache = tmp_path / "cache"
    extractor = TinyExtractor()
    first = ev.load_reference(tmp_path / "ref", extractor, cache_dir=cache)
    (cache_file,) = cache.iterdir()
    with np.load(cache_file) as archive:
        arrays = {name: archive[name] for name in archive.files}
    arrays["sigma"] = arrays["sigma"][:10, :10]  # same key, contents that do not fit
    np.savez(cache_file, **arrays)
    with pytest.warns(UserWarning, match=r"ignoring reference cache .*'sigma' has shape \(10, 10\)"):
        again = ev.load_reference(tmp_path / "ref", extractor, cache_dir=cache)
    assert not again.from_cache
    np.testing.assert_array_equal(again.pool.sigma, first.pool.sigma)
    assert ev.load_reference(tmp_path / "ref", extractor, cache_dir=cache).from_cache  # rewritten, good again


def test_resolution_mismatch_is_refused_unless_allowed(tmp_path):
    """Reproduction: 32 px samples against a 64 px reference gave an FID without a word."""
    _write_pngs(tmp_path / "ref64", _smooth_images(5, 64))
    extractor = TinyExtractor()
    samples32 = _noise_images(5, 32)
    for samples in (CountingSource(samples32), samples32, iter([samples32[:3], samples32[3:]])):
        with pytest.raises(InvalidInput, match=r"32x32 px .*ref64.* 64x64 px") as error:
            ev.evaluate(samples, tmp_path / "ref64", extractor=extractor, use_cache=False)
        assert "allow_resolution_mismatch" in error.value.parameters
        assert extractor.calls == 0
    # an ADM reference batch has the resolution of its arr_0
    adm = _adm_reference(tmp_path / "adm.npz", _smooth_images(5, 64))
    with pytest.raises(ValueError, match="64x64 px"):
        ev.evaluate(CountingSource(samples32), adm, extractor=extractor, use_cache=False)
    # a ReferenceStatistics object carries its resolution
    ref = ev.load_reference(tmp_path / "ref64", extractor, use_cache=False)
    calls = extractor.calls
    with pytest.raises(ValueError, match="32x32 px .* 64x64 px"):
        ev.evaluate(iter([samples32]), ref, extractor=extractor)
    assert extractor.calls == calls

    allowed = ev.evaluate(samples32, ref, extractor=extractor, allow_resolution_mismatch=True)
    record = allowed.to_dict()
    assert record["allow_resolution_mismatch"] is True
    assert (record["sample_resolution"], record["reference_resolution"]) == (32, 64)
    assert any("allowed by allow_resolution_mismatch" in note for note in record["notes"])
    same = ev.evaluate(_noise_images(5, 64), ref, extractor=extractor).to_dict()
    assert same["allow_resolution_mismatch"] is False and not any("resolution" in n for n in same["notes"])


def test_statistics_only_reference_says_its_resolution_is_unknown(tmp_path):
    extractor = TinyExtractor()
    stats = ev.compute_statistics(ev.extract_features(_smooth_images(6, 16), extractor).pool)
    ref = _save(tmp_path / "stats.npz", mu=stats.mu, sigma=stats.sigma)
    result = ev.evaluate(_noise_images(6, 32), ref, extractor=extractor, use_cache=False)
    assert result.reference_resolution is None and result.sample_resolution == 32
    assert any("reference resolution unknown" in note and "32x32" in note for note in result.notes)


def test_evaluate_checks_its_numeric_arguments_first(tmp_path):
    extractor = TinyExtractor()
    samples = CountingSource(_noise_images(5, 16))
    for kwargs in ({"batch_size": 0}, {"num_workers": -1}, {"split_size": 0}, {"k": 0}):
        with pytest.raises(InvalidInput) as error:
            ev.evaluate(samples, tmp_path / "missing", extractor=extractor, **kwargs)
        assert error.value.parameters == tuple(kwargs)
    assert samples.batches_read == 0


@pytest.mark.slow
def test_evaluate_script_resolution_mismatch(tmp_path, random_weights, evaluate_script, refuses):
    _write_pngs(tmp_path / "ref", _smooth_images(4, 24))
    _write_pngs(tmp_path / "samples", _noise_images(4, 16))
    out = tmp_path / "metrics.json"
    argv = ["--samples", tmp_path / "samples", "--ref", tmp_path / "ref", "--inception-weights", random_weights,
            "--device", "cpu", "--num-workers", "0", "--no-cache", "--output", out]  # fmt: skip
    refuses("evaluate", argv, r"--samples .*16x16 px .*--ref .*24x24 px.*--allow-resolution-mismatch")
    payload = evaluate_script.main(evaluate_script.parse_args([str(a) for a in argv] + ["--allow-resolution-mismatch"]))
    assert json.loads(out.read_text()) == payload
    assert payload["allow_resolution_mismatch"] is True
    assert (payload["sample_resolution"], payload["reference_resolution"]) == (16, 24)


@pytest.fixture
def evaluate_inputs(tmp_path, random_weights):
    """Valid inputs for scripts/evaluate.py; each bad-flag row changes one thing."""
    _write_pngs(tmp_path / "samples", _noise_images(4, 16))
    _write_pngs(tmp_path / "ref", _smooth_images(4, 16))
    _adm_reference(tmp_path / "bad_sigma.npz", _smooth_images(4, 16), dim=2048, spatial_dim=2023, sigma=np.eye(3))
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "garbage.npz").write_bytes(b"not a zip")
    return {
        "--samples": tmp_path / "samples", "--ref": tmp_path / "ref", "--inception-weights": random_weights,
        "--device": "cpu", "--num-workers": "0", "--cache-dir": tmp_path / "cache", "--output": tmp_path / "out.json",
    }  # fmt: skip


EVALUATE_BAD_FLAGS = [
    ({"--batch-size": "0"}, "--batch-size .*got 0"),
    ({"--batch-size": "-3"}, "--batch-size .*got -3"),
    ({"--batch-size": "two"}, "invalid int value"),
    ({"--num-workers": "-1"}, "--num-workers .*got -1"),
    ({"--split-size": "0"}, "--split-size .*got 0"),
    ({"--samples": "{tmp}/missing"}, "--samples .*missing: no such file"),
    ({"--ref": "{tmp}/missing.npz"}, "--ref .*missing.npz: no such file"),
    ({"--samples": "{tmp}/garbage.npz"}, r"garbage\.npz .*\.npz"),
    ({"--inception-weights": "{tmp}/none.pth"}, "--inception-weights .*none.pth: no such file"),
    ({"--output": "{tmp}/a_folder"}, "--output .*a_folder is a folder"),
    ({"--output": "{tmp}/no/such/dir/out.json"}, "--output .*does not exist"),
    ({"--cache-dir": "{tmp}/a_file"}, "--cache-dir .*a_file is a file"),
    ({"--device": "gpu"}, "--device .*'gpu'"),
    ({"--ref": "{tmp}/bad_sigma.npz"}, r"'sigma' .*\(3, 3\) .*\(2048, 2048\)"),
    # What evaluate writes never is, lies in or holds what it reads; a file it did not write stays.
    ({"--output": "{tmp}/samples/out.json"}, r"--output .*out\.json lies inside --samples"),
    ({"--cache-dir": "{tmp}/ref/cache"}, r"--cache-dir .*cache lies inside --ref"),
    ({"--cache-dir": "{tmp}"}, r"--cache-dir .* contains --samples"),
    ({"--output": "{tmp}/a_file"}, r"--output .*a_file .*moh-dit evaluate"),
]
if not torch.cuda.is_available():
    EVALUATE_BAD_FLAGS.append(({"--device": "cuda"}, "CUDA is not available"))


@pytest.mark.parametrize("change, match", EVALUATE_BAD_FLAGS)
def test_evaluate_script_refuses_bad_flags(tmp_path, evaluate_inputs, refuses, change, match):
    flags = {**evaluate_inputs, **{k: v.format(tmp=tmp_path) for k, v in change.items()}}
    refuses("evaluate", [item for pair in flags.items() for item in pair], match)


# ---------------------------------------------------------------------------------------------
# The package: every old name, one way in to reference statistics, module boundaries
# ---------------------------------------------------------------------------------------------


def test_every_public_name_is_importable_from_the_package():
    from moh_dit.utils import runtime

    for name in [*ev.__all__, "IMG_EXTENSIONS", "INCEPTION_WEIGHTS_SHA256_PREFIX", "NOT_COMPARABLE",
                 "FolderImageSource", "NpzImageSource", "PathLike"]:  # fmt: skip
        assert hasattr(ev, name), name
    assert ev.tf32_disabled is runtime.tf32_disabled


def test_load_reference_checks_given_statistics_as_evaluate_does(tmp_path):
    extractor = TinyExtractor()
    ref = ev.load_reference(_write_pngs(tmp_path / "ref", _smooth_images(5, 16))[0].parents[1], extractor, use_cache=False)
    assert ev.load_reference(ref, extractor) is ref
    broken = dataclasses.replace(ref, pool=ev.FeatureStatistics(ref.pool.mu, ref.pool.sigma[:-1]))
    with pytest.raises(ValueError, match=r"'sigma' has shape \(47, 48\)"):
        ev.load_reference(broken, extractor)
    other = TinyExtractor()
    with torch.no_grad():
        other.proj.add_(1.0)
    with pytest.raises(ValueError, match="recompute them with the same extractor"):
        ev.load_reference(ref, other)


def test_evaluate_and_load_reference_share_the_reference_cache(tmp_path):
    _write_pngs(tmp_path / "ref", _smooth_images(6, 16))
    cache = tmp_path / "cache"
    extractor = TinyExtractor()
    loaded = ev.load_reference(tmp_path / "ref", extractor, cache_dir=cache)
    calls = extractor.calls
    samples = _noise_images(6, 16)
    from_path = ev.evaluate(samples, tmp_path / "ref", extractor=extractor, cache_dir=cache)
    assert from_path.reference_from_cache and len(list(cache.iterdir())) == 1
    assert extractor.calls == calls + 1  # the one batch of samples; the reference came from the cache
    from_object = ev.evaluate(samples, loaded, extractor=extractor)
    for key in ("fid", "sfid", "inception_score", "precision", "recall"):
        assert getattr(from_object, key) == getattr(from_path, key)


def test_downloaded_weights_are_put_in_place_whole(no_weights_anywhere, monkeypatch):
    import hashlib

    from moh_dit.evaluation import inception

    content = b"stand-in for the published weights"
    monkeypatch.setattr(inception, "INCEPTION_WEIGHTS_SHA256_PREFIX", hashlib.sha256(content).hexdigest()[:8])

    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: FakeResponse([content[:10], content[10:]]))
    assert ev.resolve_inception_weights(download=True) == no_weights_anywhere
    assert no_weights_anywhere.read_bytes() == content
    assert list(no_weights_anywhere.parent.iterdir()) == [no_weights_anywhere]  # no temporary file left


def test_package_modules_form_no_import_cycle():
    import ast

    package = ROOT / "moh_dit" / "evaluation"
    imports = {}
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1]
        assert all(node.module for node in relative), f"{path.name} imports from the package front"
        imports[path.stem] = {node.module for node in relative}
    assert imports["frechet"] == imports["metrics"] == set()  # pure maths
    for name in ("frechet", "metrics"):
        assert "torch_fidelity" not in (package / f"{name}.py").read_text()
    done: set[str] = set()
    while len(done) < len(imports):  # peel off modules whose imports are all done; a cycle never peels
        ready = {name for name, needs in imports.items() if name not in done and needs <= done}
        assert ready, f"import cycle among {sorted(set(imports) - done)}"
        done |= ready
