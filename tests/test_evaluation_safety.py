"""moh-dit evaluate refuses what would give a meaningless number or touch what it reads: reference
covariances that are not positive semi-definite, an --output that is one of its inputs or a
file it did not write, image sets whose features cannot fit in memory."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moh_dit.evaluation as ev
from moh_dit.errors import InvalidInput

pytestmark = pytest.mark.usefixtures("one_thread")


class _Tiny(nn.Module):
    """A cheap stand-in for the Inception (pool, logits, spatial from 4x4 average pooling)."""

    def forward(self, images: torch.Tensor) -> dict:
        pooled = F.adaptive_avg_pool2d(images.float() / 255.0, 4).flatten(1)  # (N, 48)
        return {"pool": pooled, "logits": pooled[:, :10], "spatial": pooled[:, :6]}


def _images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """A sample .npz and a reference .npz; the random Inception replaced by the tiny stand-in."""
    monkeypatch.setattr(ev, "build_random_inception", lambda seed: _Tiny())
    np.savez(tmp_path / "samples.npz", arr_0=_images(5, 0), arr_1=np.arange(5))
    np.savez(tmp_path / "ref.npz", arr_0=_images(5, 1))
    return {"--samples": tmp_path / "samples.npz", "--ref": tmp_path / "ref.npz", "--random-inception-seed": "0",
            "--no-cache": "", "--device": "cpu", "--num-workers": "0"}


def _argv(flags: dict) -> list:
    return [item for flag, value in flags.items() for item in ((flag, value) if value != "" else (flag,))]


def test_frechet_distance_refuses_a_covariance_with_negative_eigenvalues():
    """Reproduction: frechet_distance(mu, I, mu, -I) returned 0.0."""
    mu = np.zeros(4)
    with pytest.raises(ValueError, match=r"sigma2 is not a covariance matrix: it has a negative eigenvalue \(-1"):
        ev.frechet_distance(mu, np.eye(4), mu, -np.eye(4))
    with pytest.raises(ValueError, match="sigma1 is not a covariance matrix"):
        ev.frechet_distance(mu, -np.ones((4, 4)), mu, np.eye(4))


def test_rounding_of_a_singular_covariance_is_not_refused():
    """Fewer images than dimensions give a singular covariance whose zero eigenvalues come out
    slightly negative, more so when stored as float32: that is rounding, not damage."""
    x = np.random.default_rng(0).standard_normal((10, 64))
    stats = ev.compute_statistics(x)
    assert abs(np.linalg.eigvalsh(stats.sigma)[:50]).max() < 1e-12  # 54 of the 64 are zero up to rounding
    assert ev.frechet_distance(stats.mu, stats.sigma, stats.mu, stats.sigma) == pytest.approx(0.0, abs=1e-6)
    low = stats.sigma.astype(np.float32)
    assert ev.frechet_distance(stats.mu, low, stats.mu, stats.sigma) == pytest.approx(0.0, abs=1e-3)


@pytest.fixture(scope="module")
def negative_reference(tmp_path_factory):
    """An ADM reference batch whose sigma is -ones((2048, 2048)) (outside each test's tmp_path)."""
    path = tmp_path_factory.mktemp("negative") / "ref.npz"
    np.savez(path, mu=np.zeros(2048), sigma=-np.ones((2048, 2048)), arr_0=_images(4, 2))
    return path


def test_a_reference_whose_sigma_is_not_a_covariance_is_refused_before_any_feature(inputs, negative_reference,
                                                                                   refuses):
    """Reproduction: evaluate accepted it and wrote "fid": -1915.0."""
    refuses("evaluate", _argv({**inputs, "--ref": negative_reference}),
            r"reference .*ref\.npz: 'sigma' is not a covariance matrix: it has a negative eigenvalue \(-2048")


@pytest.mark.parametrize("flag", ["--samples", "--labels"])
def test_output_is_never_an_input(flag, inputs, tmp_path, refuses):
    np.save(tmp_path / "labels.npy", np.arange(5))
    extra = {"--labels": tmp_path / "labels.npy", "--classifier": "torchvision:resnet18"} if flag == "--labels" else {}
    target = tmp_path / ("samples.npz" if flag == "--samples" else "labels.npy")
    refuses("evaluate", _argv({**inputs, **extra, "--output": target}), rf"--output .* is {flag}")


def test_an_earlier_result_is_replaced(inputs, tmp_path, load_script):
    out = tmp_path / "m.json"
    script = load_script("evaluate")
    for _ in range(2):
        assert script.cli([str(a) for a in _argv({**inputs, "--output": out})]) == 0
    payload = json.loads(out.read_text())
    assert payload["num_samples"] == 5 and payload["fid"] is not None
    from moh_dit.commands.evaluate import is_evaluation_result

    assert is_evaluation_result(out) and not is_evaluation_result(tmp_path / "samples.npz")


def test_image_sets_whose_features_cannot_fit_are_refused_first(inputs, refuses, monkeypatch):
    from moh_dit.utils import resources

    monkeypatch.setattr(resources, "available_memory", lambda: 2**16)
    refuses("evaluate", _argv(inputs), r"5 samples of .*samples\.npz .*10 images .*64\.0 KiB available")


@pytest.mark.parametrize("change, parameter, flag", [
    ({"--batch-size": "0"}, "batch_size", "--batch-size"),
    ({"--ref": "{tmp}/none.npz"}, "reference", "--ref"),  # a flag spelled otherwise than its parameter
])
def test_a_python_caller_reads_the_parameter_and_the_command_its_flag(inputs, tmp_path, load_script, capsys, change,
                                                                      parameter, flag):
    """One refusal, two audiences: evaluate() names its parameter, moh-dit evaluate the flag."""
    flags = {**inputs, **{k: v.format(tmp=tmp_path) for k, v in change.items()}}
    kwargs = {"batch_size": int(flags["--batch-size"])} if "--batch-size" in flags else {}
    with pytest.raises(InvalidInput if parameter == "batch_size" else FileNotFoundError) as error:
        ev.evaluate(flags["--samples"], flags["--ref"], extractor=_Tiny(), **kwargs)
    assert error.value.parameters == (parameter,) and parameter in str(error.value) and "--" not in str(error.value)
    assert load_script("evaluate").cli([str(a) for a in _argv(flags)]) == 1
    err = capsys.readouterr().err
    assert f"error: {flag} " in err and parameter not in err


def test_feature_memory_follows_the_extractor():
    assert ev.feature_bytes_per_image() == 8 * (2048 + 1008 + 2023)

    class Small(nn.Module):
        pool_dim, spatial_dim, num_logits = 10, 5, 3

    assert ev.feature_bytes_per_image(Small()) == 8 * 18


def test_a_full_disk_while_writing_the_output_is_one_line_naming_it(inputs, tmp_path, load_script, monkeypatch,
                                                                    capsys):
    import errno
    import os

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(json, "dump", full)
    out = tmp_path / "m.json"
    assert load_script("evaluate").cli([str(a) for a in _argv({**inputs, "--output": out, "--quiet": ""})]) == 1
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "Traceback" in line or line.startswith("error:")] == [
        f"error: No space left on device while writing {out}"]
    assert not out.exists() and not list(tmp_path.glob(".m.json*"))
