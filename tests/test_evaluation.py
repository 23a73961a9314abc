"""moh_dit.evaluation and moh-dit evaluate: ADM's formulas, torch-fidelity's Inception and FID,
streamed inputs, reference statistics and their cache, and what the command refuses. Offline:
the Inception is the seeded random one, or a cheap stand-in."""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from moh_dit import evaluation as ev
from moh_dit.evaluation import adm, inception

pytestmark = pytest.mark.usefixtures("one_thread")


class Tiny(nn.Module):
    """A cheap stand-in for the Inception: 48 pool values, 5 logits, 6 spatial values; counts its calls."""

    def __init__(self, shift: float = 0.0) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(48, 5, generator=torch.Generator().manual_seed(0)) + shift)
        self.calls = 0

    def forward(self, images: torch.Tensor) -> dict:
        self.calls += 1
        pooled = F.adaptive_avg_pool2d(images.float() / 255.0, 4).flatten(1)  # (N, 48)
        return {"pool": pooled, "logits": pooled @ self.proj, "spatial": pooled[:, :6]}


def smooth(n: int, size: int, offset: int = 0) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size]
    return np.asarray([np.stack([(xx * 7 + 13 * (i + offset)) % 256, (yy * 5 + 29 * (i + offset)) % 256,
                                 (xx + yy + 40 * i) % 256], axis=-1) for i in range(n)], dtype=np.uint8)


def noise(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def pngs(folder: Path, images: np.ndarray) -> Path:
    for i, image in enumerate(images):  # two levels: the recursive, relative-path order is exercised
        (folder / f"part{i // 4}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"part{i // 4}" / f"{i:03d}.png")
    return folder


def npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def adm_reference(path: Path, images: np.ndarray | None, dim: int = 48, spatial_dim: int = 6, **override) -> Path:
    arrays = {"mu": np.zeros(dim), "sigma": np.eye(dim), "mu_s": np.zeros(spatial_dim), "sigma_s": np.eye(spatial_dim),
              "arr_0": images, **override}
    return npz(path, **{k: v for k, v in arrays.items() if v is not None})


class Counting:
    """Sample images that count the batches read (none may be read before a refusal)."""

    def __init__(self, images: np.ndarray) -> None:
        self.read = 0
        array = torch.from_numpy(images)

        def batches(b, w):
            for batch in array.split(b):
                self.read += 1
                yield batch

        self.images = ev.Images("<counting>", len(images), images.shape[1], batches)


@pytest.fixture(scope="module")
def random_weights(tmp_path_factory) -> Path:
    return ev.save_random_inception_weights(tmp_path_factory.mktemp("weights") / "random-inception.pth", seed=0)


@pytest.fixture(autouse=True)
def cache_home(tmp_path_factory, monkeypatch) -> Path:
    """$MOH_DIT_CACHE in a temporary folder: no test writes into the home folder's cache."""
    root = tmp_path_factory.mktemp("moh-dit-cache")
    monkeypatch.setenv(ev.CACHE_ENV, str(root))
    return root


@pytest.fixture
def no_weights_anywhere(tmp_path, monkeypatch) -> Path:
    """No variable, an empty torch hub folder, and every download recorded and failing."""
    monkeypatch.delenv(ev.INCEPTION_WEIGHTS_ENV, raising=False)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    attempts = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: attempts.append(a) or _raise(OSError("offline")))
    return tmp_path / "hub" / "checkpoints" / ev.INCEPTION_WEIGHTS_NAME, attempts


def _raise(error):
    raise error


# ----- Frechet distance -----------------------------------------------------------------------

def _spd(rng, d):
    a = rng.standard_normal((d, 2 * d))
    return a @ a.T / (2 * d) + 0.1 * np.eye(d)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_frechet_distance_matches_scipy_sqrtm(seed):
    rng = np.random.default_rng(seed)
    mu1, mu2, s1, s2 = rng.standard_normal(24), rng.standard_normal(24), _spd(rng, 24), _spd(rng, 24)
    covmean = np.real(scipy.linalg.sqrtm(s1 @ s2))
    expected = (mu1 - mu2) @ (mu1 - mu2) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean)
    assert ev.frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, abs=1e-6)


def test_frechet_distance_closed_form_and_zero_for_a_set_with_itself():
    v1, v2 = np.array([1.0, 4.0, 0.25]), np.array([4.0, 1.0, 1.0])
    fid = ev.frechet_distance(np.array([0.0, 1.0, 2.0]), np.diag(v1), np.array([1.0, 1.0, 0.0]), np.diag(v2))
    assert fid == pytest.approx(5.0 + np.sum(v1 + v2 - 2 * np.sqrt(v1 * v2)), abs=1e-12)
    rng = np.random.default_rng(0)
    full = ev.compute_statistics(rng.standard_normal((200, 8)))
    assert abs(full.frechet_distance(full)) < 1e-10
    singular = ev.compute_statistics(rng.standard_normal((10, 50)))  # N < D, as in small tests
    assert abs(singular.frechet_distance(singular)) < 1e-10 * np.trace(singular.sigma)
    low = ev.compute_statistics(rng.standard_normal((10, 64)))  # rounding of float32 storage is not refused
    assert ev.frechet_distance(low.mu, low.sigma.astype(np.float32), low.mu, low.sigma) == pytest.approx(0, abs=1e-3)


@pytest.mark.parametrize("n1, n2, d", [(6, 9, 40), (60, 45, 8)])
def test_frechet_distance_from_features_matches_the_covariance_route(n1, n2, d):
    rng = np.random.default_rng(n1)
    x1, x2 = rng.standard_normal((n1, d)), rng.standard_normal((n2, d)) * 1.5 + 0.3
    expected = ev.compute_statistics(x1).frechet_distance(ev.compute_statistics(x2))
    assert ev.frechet_distance_from_features(x1, x2) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("args", [
    (np.zeros(3), np.eye(3), np.zeros(4), np.eye(4)),
    (np.zeros(3), np.eye(3), np.zeros(3), np.triu(np.ones((3, 3)))),
    (np.zeros(4), np.eye(4), np.zeros(4), -np.eye(4)),  # reproduction: this gave 0.0
    (np.zeros(4), -np.ones((4, 4)), np.zeros(4), np.eye(4)),
])
def test_frechet_distance_refuses_what_is_not_a_mean_and_covariance(args):
    with pytest.raises(ValueError):
        ev.frechet_distance(*args)


def test_statistics_are_float64_and_unbiased():
    stats = ev.compute_statistics(np.array([[0.0, 1.0], [2.0, 1.0]], dtype=np.float32))
    assert stats.mu.dtype == stats.sigma.dtype == np.float64
    np.testing.assert_allclose(stats.sigma, [[2.0, 0.0], [0.0, 0.0]])  # divides by N - 1


# ----- Inception Score, precision and recall --------------------------------------------------

def test_inception_score_splits_in_order_like_adm():
    a, b = [1.0, 0.0], [0.0, 1.0]
    assert ev.inception_score(np.full((10, 7), 1 / 7)) == pytest.approx(1.0)
    assert ev.inception_score(np.eye(6)) == pytest.approx(6.0)
    assert ev.inception_score(np.array([a, a, b, b]), split_size=2) == pytest.approx(1.0)
    assert ev.inception_score(np.array([a, b, a, b]), split_size=2) == pytest.approx(2.0)
    assert ev.inception_score(np.array([a, a, b, b]), split_size=5000) == pytest.approx(2.0)
    assert ev.inception_score(np.array([a, b, a, b, a]), split_size=2) == pytest.approx(5 / 3)  # short last split


def test_manifold_radii_exclude_the_point_itself():
    radii = ev.manifold_radii_squared(np.array([[0.0], [1.0], [3.0], [6.0], [10.0]]), k=1, batch_size=2)
    np.testing.assert_array_equal(radii.numpy(), [1.0, 1.0, 4.0, 9.0, 16.0])


@pytest.mark.parametrize("adm_float16", [True, False])
def test_precision_recall_hand_case(adm_float16):
    # reference 0, 10, ..., 90: 3-NN radii 30 at the ends, 20 inside. Samples: a cluster near 45
    # (inside), -30 exactly on ref 0's boundary (inside: <=), a far cluster (outside). Sample radii:
    # -30 -> 76 (covers refs 0..40), 47 -> 3 (touches ref 50), 44/45/46 and the far cluster nothing.
    reference = np.arange(0, 100, 10, dtype=np.float32)[:, None]
    samples = np.array([-30, 44, 45, 46, 47, 200, 210, 220, 230], dtype=np.float32)[:, None]
    precision, recall = ev.precision_recall(reference, samples, k=3, batch_size=4, adm_float16=adm_float16)
    assert (precision, recall) == pytest.approx((5 / 9, 6 / 10))


def test_precision_recall_matches_brute_force_and_holds_one_block_at_a_time(monkeypatch):
    rng = np.random.default_rng(0)
    reference, samples = rng.standard_normal((23, 5)), rng.standard_normal((31, 5)) + 1.0

    def radii(x):
        return np.sort(((x[:, None] - x[None]) ** 2).sum(-1), axis=1)[:, 3]

    d = ((reference[:, None] - samples[None]) ** 2).sum(-1)  # (23, 31)
    expected = (np.mean((d <= radii(reference)[:, None]).any(0)), np.mean((d <= radii(samples)[None]).any(1)))
    assert 0 < expected[0] < 1 and 0 < expected[1] < 1
    shapes, distances = [], adm._squared_distances

    def recorded(u, v, adm_float16):
        shapes.append((len(u), len(v)))
        return distances(u, v, adm_float16)

    monkeypatch.setattr(adm, "_squared_distances", recorded)
    assert ev.precision_recall(reference, samples, batch_size=7, adm_float16=False) == pytest.approx(expected)
    assert max(max(shape) for shape in shapes) <= 7  # a 50k x 50k matrix never exists


# ----- the Inception --------------------------------------------------------------------------

@pytest.mark.slow
def test_inception_layers_are_torch_fidelitys_and_sfid_is_mixed_6d_first_7_channels_hwc(random_weights):
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    extractor = ev.TFInceptionV3Features.from_file(random_weights)
    images = torch.from_numpy(noise(2, 40)).permute(0, 3, 1, 2).contiguous()  # (2, 3, 40, 40)
    branch = []
    theirs = FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"],
                                         feature_extractor_weights_path=str(random_weights))
    theirs.Mixed_6d.branch1x1.register_forward_hook(lambda m, i, out: branch.append(out))
    pool, logits = theirs(images)
    ours = extractor(images)
    torch.testing.assert_close(ours["pool"], pool)
    torch.testing.assert_close(ours["logits"], logits)
    first7 = branch[0][:, :7]  # (2, 7, 17, 17), post-ReLU
    assert ours["spatial"].shape == (2, 2023) and (first7 > 0).sum() > 50
    n, c, h, w = np.unravel_index(int(first7.argmax()), first7.shape)
    assert ours["spatial"][n, (h * 17 + w) * 7 + c] == first7.max()  # ADM's [..., :7] of NHWC
    sha256 = hashlib.sha256(random_weights.read_bytes()).hexdigest()
    assert not extractor.comparable_to_published and extractor.identity.endswith(f"sha256={sha256[:16]}")
    in_memory = ev.build_random_inception(seed=0)  # the same seeded weights as the file, and says it is random
    assert all(torch.equal(v, theirs.state_dict()[k]) for k, v in in_memory.inception.state_dict().items())
    assert "RANDOM" in in_memory.identity
    assert theirs.Mixed_6d.branch1x1.conv.weight.std().item() == pytest.approx((2 / 768) ** 0.5, rel=0.05)


@pytest.mark.slow
def test_fid_of_image_folders_matches_torch_fidelity(tmp_path, random_weights):
    """The whole path: folders -> TF Inception features -> FID, against torch-fidelity's own; and the
    distance alone against torch-fidelity's on full-rank statistics."""
    import torch_fidelity
    from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric

    samples, reference = pngs(tmp_path / "samples", noise(8, 32)), pngs(tmp_path / "ref", smooth(8, 32))
    theirs = torch_fidelity.calculate_metrics(input1=str(samples), input2=str(reference), fid=True, cuda=False,
                                              feature_extractor_weights_path=str(random_weights), verbose=False,
                                              cache=False, samples_find_deep=True, save_cpu_ram=True)
    ours = ev.evaluate(samples, reference, inception_weights=random_weights, batch_size=8, use_cache=False)
    assert ours["fid"] == pytest.approx(theirs["frechet_inception_distance"], rel=1e-5)
    assert ours["fid"] > 1.0 and not ours["comparable_to_published"]
    rng = np.random.default_rng(0)
    x1, x2 = rng.standard_normal((300, 16)), rng.standard_normal((200, 16)) * 1.3 + 0.2
    theirs = fid_statistics_to_metric(fid_features_to_statistics(torch.from_numpy(x1)),
                                      fid_features_to_statistics(torch.from_numpy(x2)), False)
    ours = ev.compute_statistics(x1).frechet_distance(ev.compute_statistics(x2))
    assert ours == pytest.approx(theirs["frechet_inception_distance"], rel=1e-10)


def test_tf32_disabled_restores_the_settings():
    matmul, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    if hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision"):  # torch >= 2.9
        owners, name, on, off = (matmul, conv), "fp32_precision", "tf32", "ieee"
    else:
        owners, name, on, off = (matmul, torch.backends.cudnn), "allow_tf32", True, False
    before = [getattr(owner, name) for owner in owners]
    try:
        for owner in owners:
            setattr(owner, name, on)
        with pytest.raises(RuntimeError), ev.tf32_disabled():
            assert [getattr(owner, name) for owner in owners] == [off, off]
            raise RuntimeError("restored even on errors")
        assert [getattr(owner, name) for owner in owners] == [on, on]
    finally:
        for owner, value in zip(owners, before):
            setattr(owner, name, value)


def test_weights_lookup_order_and_what_a_missing_file_says(tmp_path, monkeypatch, no_weights_anywhere):
    hub, attempts = no_weights_anywhere
    with pytest.raises(FileNotFoundError) as error:
        ev.resolve_inception_weights(download=False)
    assert error.value.filename == str(hub) and ev.INCEPTION_WEIGHTS_URL in str(error.value) and not attempts
    with pytest.raises(FileNotFoundError, match="download failed"):
        ev.resolve_inception_weights(download=True)
    assert attempts and not hub.exists()
    hub.parent.mkdir(parents=True, exist_ok=True)
    for path in (hub, tmp_path / "env.pth", tmp_path / "explicit.pth"):
        path.write_bytes(b"x")
    assert ev.resolve_inception_weights(download=False) == hub
    monkeypatch.setenv(ev.INCEPTION_WEIGHTS_ENV, str(tmp_path / "env.pth"))
    assert ev.resolve_inception_weights(download=False) == tmp_path / "env.pth"
    assert ev.resolve_inception_weights(tmp_path / "explicit.pth") == tmp_path / "explicit.pth"
    with pytest.raises(FileNotFoundError) as error:
        ev.resolve_inception_weights(tmp_path / "missing.pth")
    assert error.value.filename == str(tmp_path / "missing.pth")


class FakeResponse:
    def __init__(self, chunks):
        self.data = iter([*chunks, b""])

    def read(self, n):
        return next(self.data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_download_is_put_in_place_whole_and_only_with_the_published_hash(no_weights_anywhere, monkeypatch):
    hub, _ = no_weights_anywhere
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: FakeResponse([b"<html>a proxy page</html>"]))
    with pytest.raises(FileNotFoundError, match="SHA-256"):
        ev.resolve_inception_weights()
    assert list(hub.parent.iterdir()) == []
    content = b"stand-in for the published weights"
    monkeypatch.setattr(inception, "INCEPTION_WEIGHTS_SHA256_PREFIX", hashlib.sha256(content).hexdigest()[:8])
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: FakeResponse([content[:10], content[10:]]))
    assert ev.resolve_inception_weights() == hub and hub.read_bytes() == content
    assert list(hub.parent.iterdir()) == [hub]


# ----- images ---------------------------------------------------------------------------------

@pytest.mark.parametrize("compressed", [False, True])
def test_a_sample_npz_is_streamed_never_loaded_whole(tmp_path, compressed):
    import tracemalloc

    images = noise(4096, 16)  # 3 MiB
    (np.savez_compressed if compressed else np.savez)(tmp_path / "samples.npz", arr_0=images, arr_1=np.arange(4096))
    opened = ev.open_images(tmp_path / "samples.npz")
    assert (opened.count, opened.resolution) == (4096, 16)
    seen = 0
    tracemalloc.start()
    try:
        for batch in opened.batches(16, 0):
            assert np.array_equal(batch.numpy(), images[seen:seen + len(batch)])
            seen += len(batch)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == len(images) and peak < images.nbytes / 8


@pytest.mark.parametrize("images, error", [
    (np.zeros((2, 4, 4, 3), np.float32), ValueError),
    (np.zeros((2, 3, 4, 4), np.uint8), ValueError),  # NCHW
    (np.zeros((2, 4, 6, 3), np.uint8), ValueError),  # not square
    ("missing.npz", FileNotFoundError),
    ("garbage.npz", ValueError),
])
def test_images_are_checked_when_opened(tmp_path, images, error):
    (tmp_path / "garbage.npz").write_bytes(b"not a zip")
    if isinstance(images, np.ndarray):
        images = npz(tmp_path / "x.npz", arr_0=images)
    with pytest.raises(error):
        ev.open_images(tmp_path / images if isinstance(images, str) else images)


def test_folders_are_read_recursively_in_order(tmp_path):
    folder = pngs(tmp_path / "images", smooth(6, 8))  # part0/000..003, part1/004..005
    (folder / "notes.txt").write_text("ignored")
    opened = ev.open_images(folder)
    assert (opened.count, opened.resolution) == (6, 8)
    np.testing.assert_array_equal(torch.cat(list(opened.batches(4, 0))).numpy(), smooth(6, 8))


# ----- references and evaluate ----------------------------------------------------------------

def test_reference_statistics_are_cached_by_images_and_extractor(tmp_path, cache_home, caplog):
    caplog.set_level("INFO", logger=adm.__name__)
    first_png = pngs(tmp_path / "ref", smooth(8, 16)) / "part0" / "000.png"
    extractor = Tiny()
    first = ev.load_reference(tmp_path / "ref", extractor, batch_size=3)
    assert not first.from_cache and extractor.calls == 3
    (cached,) = (cache_home / "reference_stats").iterdir()
    assert f"wrote the reference statistics cache {cached}" in caplog.text
    second = ev.load_reference(tmp_path / "ref", extractor, batch_size=3)
    assert second.from_cache and extractor.calls == 3
    np.testing.assert_array_equal(second.pool.sigma, first.pool.sigma)
    assert not ev.load_reference(tmp_path / "ref", Tiny(shift=1.0)).from_cache  # other weights
    assert not ev.load_reference(tmp_path / "ref", extractor, use_cache=False).from_cache
    Image.fromarray(noise(1, 16)[0]).save(first_png)  # a changed image
    os.utime(first_png, ns=(1, 1))
    third = ev.load_reference(tmp_path / "ref", extractor, cache_dir=tmp_path / "cache")
    assert not third.from_cache and not np.allclose(third.pool.mu, first.pool.mu)
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".npz"]


def test_reference_cache_folder(tmp_path, monkeypatch):
    assert ev.reference_cache_dir() == Path(os.environ[ev.CACHE_ENV]) / "reference_stats"
    monkeypatch.delenv(ev.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ev.reference_cache_dir() == tmp_path / "xdg" / "moh-dit" / "reference_stats"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ev.reference_cache_dir() == tmp_path / "home" / ".cache" / "moh-dit" / "reference_stats"


def test_an_adm_reference_batch_gives_fid_from_its_stored_statistics(tmp_path):
    images, extractor = smooth(10, 16), Tiny()
    features = ev.extract_features(images, extractor, batch_size=4)
    pool, spatial = ev.compute_statistics(features.pool), ev.compute_statistics(features.spatial)
    ref = npz(tmp_path / "ref.npz", arr_0=images, mu=pool.mu, sigma=pool.sigma, mu_s=spatial.mu, sigma_s=spatial.sigma)
    result = ev.evaluate(images, ref, extractor=extractor, batch_size=4)
    assert abs(result["fid"]) < 1e-9 and abs(result["sfid"]) < 1e-9 and result["num_reference_images"] == 10
    assert (result["precision"], result["recall"]) == (1.0, 1.0) and not result["comparable_to_published"]
    # FID comes from the stored mu, not from arr_0: shift it by 1 in each of 48 dimensions.
    shifted = npz(tmp_path / "shifted.npz", arr_0=images, mu=pool.mu + 1, sigma=pool.sigma, mu_s=spatial.mu,
                  sigma_s=spatial.sigma)
    batches = iter([images[:6], torch.from_numpy(images[6:])])  # samples straight from a pipeline
    result = ev.evaluate(batches, shifted, extractor=extractor, batch_size=4, use_cache=False)
    assert result["fid"] == pytest.approx(48.0) and abs(result["sfid"]) < 1e-9
    assert (result["precision"], result["recall"], result["num_samples"]) == (1.0, 1.0, 10)
    # a statistics file: FID and sFID, no precision/recall, resolution unknown
    stats = npz(tmp_path / "stats.npz", mu=pool.mu, sigma=pool.sigma)
    result = ev.evaluate(noise(6, 32), stats, extractor=extractor, use_cache=False)
    assert result["fid"] > 0 and result["sfid"] is result["precision"] is result["reference_resolution"] is None


@pytest.mark.parametrize("override", [
    {"sigma": np.eye(47)}, {"mu": np.zeros((48, 1))}, {"sigma_s": np.eye(5)}, {"sigma_s": None},
    {"sigma": np.full((48, 48), np.nan)}, {"sigma": np.triu(np.ones((48, 48)))},
    {"sigma": -np.ones((48, 48))},  # reproduction: "fid": -1915.0
    {"sigma_s": -np.eye(6)},
])
def test_bad_reference_statistics_are_refused_before_any_feature(tmp_path, override):
    ref = adm_reference(tmp_path / "ref.npz", smooth(6, 16), **override)
    samples, extractor = Counting(noise(6, 16)), Tiny()
    with pytest.raises(ValueError):
        ev.evaluate(samples.images, ref, extractor=extractor, batch_size=2, cache_dir=tmp_path / "cache")
    assert samples.read == extractor.calls == 0 and not (tmp_path / "cache").exists()


def test_stored_statistics_must_have_the_inception_widths(tmp_path):
    extractor = Tiny()
    extractor.pool_dim, extractor.spatial_dim = 2048, 2023
    samples = Counting(noise(4, 16))
    with pytest.raises(ValueError, match="48 values"):
        ev.evaluate(samples.images, adm_reference(tmp_path / "ref.npz", smooth(4, 16)), extractor=extractor)
    assert samples.read == extractor.calls == 0


def test_resolution_mismatch_is_refused_unless_allowed(tmp_path):
    """Reproduction: 32 px samples against a 64 px reference gave an FID without a word."""
    ref64, extractor, samples32 = pngs(tmp_path / "ref64", smooth(5, 64)), Tiny(), noise(5, 32)
    for samples in (samples32, iter([samples32[:3], samples32[3:]]),
                    adm_reference(tmp_path / "adm.npz", smooth(5, 32))):
        with pytest.raises(ValueError, match="32 px .* 64 px"):
            ev.evaluate(samples, ref64, extractor=extractor, use_cache=False)
    reference = ev.load_reference(ref64, extractor, use_cache=False)
    calls = extractor.calls
    with pytest.raises(ValueError, match="allow_resolution_mismatch"):
        ev.evaluate(samples32, reference, extractor=extractor)
    assert extractor.calls == calls
    allowed = ev.evaluate(samples32, reference, extractor=extractor, allow_resolution_mismatch=True)
    assert allowed["allow_resolution_mismatch"] and (allowed["sample_resolution"], allowed["reference_resolution"]) \
        == (32, 64)


def test_a_reference_is_reused_as_an_object_with_the_same_numbers(tmp_path):
    ref, extractor, samples = pngs(tmp_path / "ref", smooth(6, 16)), Tiny(), noise(6, 16)
    loaded = ev.load_reference(ref, extractor, cache_dir=tmp_path / "cache")
    from_path = ev.evaluate(samples, ref, extractor=extractor, cache_dir=tmp_path / "cache")
    assert from_path["reference_from_cache"]
    from_object = ev.evaluate(samples, loaded, extractor=extractor)
    assert all(from_object[key] == from_path[key] for key in ("fid", "sfid", "inception_score", "precision", "recall"))
    with pytest.raises(ValueError, match="made with"):
        ev.evaluate(samples, loaded, extractor=Tiny(shift=1.0))


# ----- moh-dit evaluate -----------------------------------------------------------------------

@pytest.fixture
def flags(tmp_path, monkeypatch):
    """A sample .npz with labels and a reference folder; the random Inception is the cheap stand-in."""
    monkeypatch.setattr(inception, "build_random_inception", lambda seed: Tiny())
    npz(tmp_path / "samples.npz", arr_0=noise(5, 16), arr_1=np.arange(5))
    pngs(tmp_path / "ref", smooth(5, 16))
    return {"--samples": tmp_path / "samples.npz", "--ref": tmp_path / "ref", "--random-inception-seed": 0,
            "--device": "cpu", "--num-workers": 0, "--cache-dir": tmp_path / "cache", "--output": tmp_path / "m.json"}


def argv(flags: dict) -> list:
    return [item for flag, value in flags.items() for item in ((flag,) if value is None else (flag, value))]


def test_evaluate_writes_the_json_and_replaces_only_an_earlier_result(flags, tmp_path, load_script, refuses, capsys):
    for _ in range(2):
        assert load_script("evaluate").cli(argv(flags)) == 0 and "NOT comparable" in capsys.readouterr().err
    result = json.loads((tmp_path / "m.json").read_text())
    assert {"fid", "sfid", "inception_score", "precision", "recall"} <= set(result) and result["num_samples"] == 5
    assert result["reference_from_cache"] and len(list((tmp_path / "cache").iterdir())) == 1
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    refuses("evaluate", argv({**flags, "--output": tmp_path / "notes.json"}), "notes.json")


@pytest.mark.parametrize("change, match", [
    ({"--output": "{tmp}/samples.npz"}, "samples.npz"),
    ({"--output": "{tmp}/ref/m.json"}, "ref"),
    ({"--cache-dir": "{tmp}/ref/cache"}, "ref"),
    ({"--cache-dir": "{tmp}"}, "samples.npz"),
    ({"--samples": "{tmp}/missing.npz"}, "missing.npz"),
    ({"--ref": "{tmp}/missing"}, "missing"),
    ({"--labels": "{tmp}/samples.npz"}, "--classifier"),
    ({"--batch-size": "0"}, "--batch-size"),
    ({"--num-workers": "-1"}, "--num-workers"),
    ({"--device": "gpu"}, "gpu"),
    ({"--random-inception-seed": "-1"}, "--random-inception-seed"),
    ({"--inception-weights": "{tmp}/w.pth"}, "not allowed with"),
])
def test_evaluate_refuses_before_writing_anything(flags, tmp_path, refuses, change, match):
    """What it writes never is or lies in what it reads; bad values are one line naming them."""
    refuses("evaluate", argv({**flags, **{k: v.format(tmp=tmp_path) for k, v in change.items()}}), match)


def test_no_download_never_tries_to_download_the_weights(flags, no_weights_anywhere, refuses):
    hub, attempts = no_weights_anywhere
    del flags["--random-inception-seed"]
    refuses("evaluate", argv(flags), "download failed")
    assert attempts
    attempts.clear()
    err = refuses("evaluate", argv({**flags, "--no-download": None}), "downloading was disabled")
    assert not attempts and str(hub) in err and ev.INCEPTION_WEIGHTS_URL in err


@pytest.mark.slow
def test_evaluate_end_to_end_with_the_random_inception(tmp_path, random_weights, load_script):
    """Offline: the seed's in-memory weights give the numbers of its weights file."""
    pngs(tmp_path / "ref", smooth(6, 16))
    npz(tmp_path / "samples.npz", arr_0=noise(6, 32)[:, 8:24, 8:24])
    common = ["--samples", tmp_path / "samples.npz", "--ref", tmp_path / "ref", "--device", "cpu", "--num-workers", 0,
              "--no-cache", "--no-download", "--batch-size", 6]
    evaluate = load_script("evaluate")
    assert evaluate.cli([*common, "--random-inception-seed", 0, "--output", tmp_path / "random.json"]) == 0
    assert evaluate.cli([*common, "--inception-weights", random_weights, "--output", tmp_path / "file.json"]) == 0
    random, from_file = (json.loads((tmp_path / name).read_text()) for name in ("random.json", "file.json"))
    assert "RANDOM-kaiming-seed=0" in random["extractor"] and not random["comparable_to_published"]
    assert all(np.isfinite(random[key]) for key in ("fid", "sfid", "inception_score", "precision", "recall"))
    assert from_file["fid"] == pytest.approx(random["fid"], rel=1e-9) and random["fid"] > 0
