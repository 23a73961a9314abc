"""The feature network: torch-fidelity's TF-compatible InceptionV3 with ADM's three layers.

Finding the weights file (:func:`resolve_inception_weights`: explicit path, environment
variable, torch hub cache, download), loading it safely (``weights_only=True``) into
:class:`TFInceptionV3Features`, and the seeded random weights used offline
(:func:`build_random_inception`, :func:`save_random_inception_weights`), whose numbers are
labelled as not comparable to published ones.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InputNotFound
from ..utils.io import atomic_write, sha256_file
from ..utils.runtime import tf32_disabled
from .features import FeatureExtractor, InceptionFeatures
from .sources import PathLike

__all__ = [
    "INCEPTION_WEIGHTS_ENV",
    "INCEPTION_WEIGHTS_NAME",
    "INCEPTION_WEIGHTS_SHA256_PREFIX",
    "INCEPTION_WEIGHTS_URL",
    "MAX_RANDOM_INCEPTION_SEED",
    "NOT_COMPARABLE",
    "InceptionWeightsNotFoundError",
    "TFInceptionV3Features",
    "build_random_inception",
    "load_inception",
    "random_inception_state_dict",
    "resolve_inception_weights",
    "save_random_inception_weights",
]

# torch-fidelity's conversion of the 2015-12-05 TF Inception graph (the same weights as
# pytorch-fid's pt_inception-2015-12-05-6726825d.pth). Following the torch hub convention,
# the 8 hex digits in the name are the start of the file's SHA-256; that is how a file is
# recognised as the published weights (and a randomly initialised one is not).
INCEPTION_WEIGHTS_NAME = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_WEIGHTS_URL = (
    "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/" + INCEPTION_WEIGHTS_NAME
)
INCEPTION_WEIGHTS_SHA256_PREFIX = "6726825d"
INCEPTION_WEIGHTS_ENV = "MOH_DIT_INCEPTION_WEIGHTS"

NOT_COMPARABLE = "not comparable to published numbers"
MAX_RANDOM_INCEPTION_SEED = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


class InceptionWeightsNotFoundError(InputNotFound):
    """The InceptionV3 weights file could not be found or downloaded."""


def _check_uint8_nchw(images: torch.Tensor) -> None:
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8:
        raise TypeError(f"expected a uint8 torch.Tensor (N, 3, H, W), got {getattr(images, 'dtype', type(images))}")
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images of shape (N, 3, H, W), got {tuple(images.shape)}")


class TFInceptionV3Features(FeatureExtractor):
    """ADM's feature layers from torch-fidelity's TF-compatible InceptionV3.

    ``pool`` = pool_3 (2048), ``logits`` = pool_3 @ W without bias (1008, torch-fidelity's
    ``"logits_unbiased"``) and ``spatial`` = ``Mixed_6d.branch1x1`` (the TF graph's
    ``mixed_6/conv``, post-ReLU, (N, 192, 17, 17)) cut to channels [:7] and flattened in
    height-width-channel order (ADM slices ``[..., :7]`` of an NHWC tensor), 2023 values.
    The spatial layer is read with a forward hook so the forward pass is torch-fidelity's own.
    Extraction runs in float32 with TF32 disabled.
    """

    pool_dim = 2048
    spatial_dim = 17 * 17 * 7
    num_logits = 1008

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        identity: str,
        comparable_to_published: bool = False,
        weights_info: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        # torch-fidelity only loads weights from a path/file object (with pickle); hand it the
        # already validated tensors through memory so its own constructor and strict load run.
        buffer = io.BytesIO()
        torch.save(dict(state_dict), buffer)
        buffer.seek(0)
        try:
            self.inception = FeatureExtractorInceptionV3(
                "inception-v3-compat",
                features_list=["2048", "logits_unbiased"],
                feature_extractor_weights_path=buffer,
            )
        except RuntimeError as error:
            raise ValueError(
                "the weights are not a TF-compatible InceptionV3 state dict in torch-fidelity / "
                f"pytorch-fid format ({INCEPTION_WEIGHTS_NAME}): {error}"
            ) from error
        self.identity = identity
        self.comparable_to_published = comparable_to_published
        self.weights_info = dict(weights_info or {})
        self._spatial: torch.Tensor | None = None
        self.inception.Mixed_6d.branch1x1.register_forward_hook(self._capture_spatial)

    @classmethod
    def from_file(cls, path: PathLike) -> "TFInceptionV3Features":
        """Load weights from ``path`` (a ``.pth`` state dict), safely (``weights_only=True``)."""
        path = Path(path)
        if not path.is_file():
            raise InceptionWeightsNotFoundError(f"Inception weights file not found: {path}")
        sha256 = sha256_file(path)
        try:
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # corrupt file, HTML page saved as .pth, ...
            raise ValueError(f"could not read Inception weights {path}: {error}") from error
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"{path} does not hold a state dict (got {type(state_dict).__name__})")
        comparable = sha256.startswith(INCEPTION_WEIGHTS_SHA256_PREFIX)
        return cls(
            state_dict,
            identity=f"tf-inception-v3-compat:sha256={sha256[:16]}",
            comparable_to_published=comparable,
            weights_info={"path": str(path.resolve()), "name": path.name, "sha256": sha256},
        )

    def _capture_spatial(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        n = output.shape[0]
        self._spatial = output[:, :7].permute(0, 2, 3, 1).reshape(n, -1).float()  # (N, 17*17*7) HWC

    def forward(self, images: torch.Tensor) -> InceptionFeatures:
        _check_uint8_nchw(images)
        self._spatial = None
        with tf32_disabled(), torch.no_grad():
            pool, logits = self.inception(images)  # (N, 2048), (N, 1008)
        spatial, self._spatial = self._spatial, None
        return InceptionFeatures(pool=pool, logits=logits, spatial=spatial)


def _download_weights(destination: Path, timeout: float) -> None:
    """Download the published weights to ``destination``; a file whose SHA-256 is not theirs is never put there."""
    digest = hashlib.sha256()
    with atomic_write(destination) as out, urllib.request.urlopen(INCEPTION_WEIGHTS_URL, timeout=timeout) as response:
        for chunk in iter(lambda: response.read(1 << 20), b""):
            out.write(chunk)
            digest.update(chunk)
        sha256 = digest.hexdigest()
        if not sha256.startswith(INCEPTION_WEIGHTS_SHA256_PREFIX):
            raise OSError(
                f"downloaded file has SHA-256 {sha256}, expected it to start with {INCEPTION_WEIGHTS_SHA256_PREFIX}"
            )


def resolve_inception_weights(
    inception_weights: PathLike | None = None, *, download: bool = True, timeout: float = 10.0
) -> Path:
    """Find the Inception weights file.

    Order: ``inception_weights`` (a file) > environment variable ``MOH_DIT_INCEPTION_WEIGHTS`` > torch hub cache
    (``torch.hub.get_dir()/checkpoints/weights-inception-2015-12-05-6726825d.pth``) > a download
    from torch-fidelity's release into that cache (``download=True``, ``timeout`` seconds per
    network operation). An explicit path or environment variable that points nowhere is an
    error rather than a silent fallback. Raises :class:`InceptionWeightsNotFoundError` saying
    where to put the file and where to get it.
    """
    if inception_weights is not None:
        path = Path(inception_weights).expanduser()
        if not path.is_file():
            raise InceptionWeightsNotFoundError(
                f"inception_weights {path}: no such file. Download {INCEPTION_WEIGHTS_URL} and give its path.",
                parameters="inception_weights")
        return path
    from_env = os.environ.get(INCEPTION_WEIGHTS_ENV)
    if from_env:
        env_path = Path(from_env).expanduser()
        if not env_path.is_file():
            raise InceptionWeightsNotFoundError(
                f"{INCEPTION_WEIGHTS_ENV}={from_env} does not point to a file. Download "
                f"{INCEPTION_WEIGHTS_URL} there, or unset the variable."
            )
        return env_path
    cached = Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_WEIGHTS_NAME
    if cached.is_file():
        return cached
    failure = "downloading was disabled"
    if download:
        try:
            _download_weights(cached, timeout)
            return cached
        except Exception as error:  # no network, proxy, timeout, bad file: all end in the same advice
            failure = f"the download failed ({type(error).__name__}: {error})"
    raise InceptionWeightsNotFoundError(
        f"InceptionV3 weights not found and {failure}. Get {INCEPTION_WEIGHTS_URL} "
        f"on a machine with internet and either put it at {cached}, set "
        f"{INCEPTION_WEIGHTS_ENV}=/path/to/{INCEPTION_WEIGHTS_NAME}, or give its path as inception_weights.",
        parameters="inception_weights")


def load_inception(
    inception_weights: PathLike | None = None, *, download: bool = True, timeout: float = 10.0
) -> TFInceptionV3Features:
    """The ADM-comparable extractor with weights found by :func:`resolve_inception_weights`."""
    return TFInceptionV3Features.from_file(resolve_inception_weights(inception_weights, download=download,
                                                                     timeout=timeout))


class _InceptionV3Architecture(nn.Module):
    """torch-fidelity's InceptionV3 layer layout without weights, to make random state dicts.

    The attribute names and blocks are torch-fidelity's own, so the state dict loads strictly
    into ``FeatureExtractorInceptionV3`` (which :class:`TFInceptionV3Features` verifies).
    """

    def __init__(self) -> None:
        super().__init__()
        from torch_fidelity.feature_extractor_inceptionv3 import (
            BasicConv2d,
            InceptionA,
            InceptionB,
            InceptionC,
            InceptionD,
            InceptionE_1,
            InceptionE_2,
        )

        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, channels_7x7=128)
        self.Mixed_6c = InceptionC(768, channels_7x7=160)
        self.Mixed_6d = InceptionC(768, channels_7x7=160)
        self.Mixed_6e = InceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE_1(1280)
        self.Mixed_7c = InceptionE_2(2048)
        self.fc = nn.Linear(2048, 1008)


def random_inception_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded random InceptionV3 state dict (torch-fidelity layout); results are not comparable.

    Conv weights are Kaiming-normal (fan-in, ReLU gain: std = sqrt(2 / fan_in)) so activations
    keep their scale through the 94 conv layers; with PyTorch's default init pool_3 collapses
    to nearly constant features (FID ~ 1e-13 between unrelated image sets), useless even for
    tests. Batch norms are identities, the classifier is normal with std 1/sqrt(2048). Values
    are drawn from one seeded CPU generator, so the same seed gives the same weights anywhere.
    """
    generator = torch.Generator().manual_seed(seed)
    model = _InceptionV3Architecture()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                fan_in = module.weight[0].numel()
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * math.sqrt(2.0 / fan_in))
            elif isinstance(module, nn.BatchNorm2d):
                module.reset_parameters()  # weight 1, bias 0, running mean 0, running var 1
            elif isinstance(module, nn.Linear):
                std = 1.0 / math.sqrt(module.in_features)
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                module.bias.zero_()
    return model.state_dict()


def build_random_inception(seed: int = 0) -> TFInceptionV3Features:
    """TF-compatible InceptionV3 with random weights, for the offline CPU demo and tests.

    Its numbers are NOT comparable to published numbers; its identity and every result made
    with it say so.
    """
    return TFInceptionV3Features(
        random_inception_state_dict(seed),
        identity=f"tf-inception-v3-compat:RANDOM-kaiming-seed={seed}",
        comparable_to_published=False,
        weights_info={"name": f"random-kaiming-seed={seed}", "note": NOT_COMPARABLE},
    )


def save_random_inception_weights(path: PathLike, seed: int = 0) -> Path:
    """Write :func:`random_inception_state_dict` to ``path`` (atomically), loadable like the real file.

    Results made with it are flagged as not comparable, because its SHA-256 is not the
    published file's.
    """
    path = Path(path)
    with atomic_write(path) as f:
        torch.save(random_inception_state_dict(seed), f)
    return path
