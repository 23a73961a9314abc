"""The feature network of ADM's evaluator: torch-fidelity's ``"inception-v3-compat"``, a port of the
2015-12-05 TF InceptionV3 graph with its TF1 bilinear resize to 299 and ``(x - 128) / 128`` (other
ports resize differently, and their numbers are not comparable to ADM's)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import math
import os
import urllib.request
from pathlib import Path

import torch
from torch import nn

from ..outputs import atomic_write

INCEPTION_WEIGHTS_NAME = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_WEIGHTS_URL = "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/" + INCEPTION_WEIGHTS_NAME
# The torch hub convention: the 8 hex digits in the name start the file's SHA-256. That is how
# the published weights are recognised, and a download is accepted.
INCEPTION_WEIGHTS_SHA256_PREFIX = "6726825d"
INCEPTION_WEIGHTS_ENV = "MOH_DIT_INCEPTION_WEIGHTS"


@contextlib.contextmanager
def tf32_disabled():
    """Full float32 in the block: TF32's 10-bit mantissa moves FID in the second decimal."""
    matmul, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    if hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision"):  # torch >= 2.9 refuses mixing APIs
        switches = [(matmul, "fp32_precision", "ieee"), (conv, "fp32_precision", "ieee")]
    else:
        switches = [(matmul, "allow_tf32", False), (torch.backends.cudnn, "allow_tf32", False)]
    saved = [getattr(owner, name) for owner, name, _ in switches]
    for owner, name, off in switches:
        setattr(owner, name, off)
    try:
        yield
    finally:
        for (owner, name, _), value in zip(switches, saved):
            setattr(owner, name, value)


def _torch_fidelity(cls: type, state_dict: dict[str, torch.Tensor], features: list[str]) -> nn.Module:
    # torch-fidelity loads weights only from a file, with pickle: hand it tensors already read
    # safely, through a buffer this process wrote itself.
    buffer = io.BytesIO()
    torch.save(dict(state_dict), buffer)
    buffer.seek(0)
    return cls("inception-v3-compat", features, feature_extractor_weights_path=buffer)


class TFInceptionV3Features(nn.Module):
    """uint8 images (N, 3, H, W) -> ``pool`` (pool_3: FID, precision/recall), ``logits`` (pool_3 @ W
    without the bias: Inception Score) and ``spatial`` (``mixed_6/conv`` = ``Mixed_6d.branch1x1``, first
    7 channels: sFID). ``identity`` names the weights (cached statistics are keyed on it)."""

    pool_dim, spatial_dim = 2048, 17 * 17 * 7

    def __init__(self, state_dict: dict[str, torch.Tensor], identity: str, comparable_to_published: bool = False
                 ) -> None:
        super().__init__()
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        self.inception = _torch_fidelity(FeatureExtractorInceptionV3, state_dict, ["2048", "logits_unbiased"])
        self.identity, self.comparable_to_published = identity, comparable_to_published
        self._spatial = None
        self.inception.Mixed_6d.branch1x1.register_forward_hook(self._keep_spatial)

    def _keep_spatial(self, module, inputs, output):
        # ADM slices [..., :7] of the NHWC tensor: channel c at (h, w) is value (h * 17 + w) * 7 + c.
        self._spatial = output[:, :7].permute(0, 2, 3, 1).flatten(1).float()  # (N, 2023)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        with tf32_disabled():
            pool, logits = self.inception(images)  # (N, 2048), (N, 1008)
        spatial, self._spatial = self._spatial, None
        return {"pool": pool, "logits": logits, "spatial": spatial}

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TFInceptionV3Features":
        """torch-fidelity's weights file (or :func:`save_random_inception_weights`'), ``weights_only``."""
        path = Path(path)
        sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
        return cls(state_dict, f"tf-inception-v3-compat:{path.name}:sha256={sha256[:16]}",
                   comparable_to_published=sha256.startswith(INCEPTION_WEIGHTS_SHA256_PREFIX))


def resolve_inception_weights(inception_weights: str | os.PathLike | None = None, *, download: bool = True,
                              timeout: float = 10.0) -> Path:
    """The weights file: ``inception_weights``, else ``$MOH_DIT_INCEPTION_WEIGHTS``, else the torch hub
    cache, else (``download``) torch-fidelity's release downloaded into that cache."""
    given = inception_weights or os.environ.get(INCEPTION_WEIGHTS_ENV)
    if given:
        if not Path(given).expanduser().is_file():
            raise FileNotFoundError(errno.ENOENT, f"no Inception weights file; download {INCEPTION_WEIGHTS_URL}",
                                    str(given))
        return Path(given).expanduser()
    cached = Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_WEIGHTS_NAME
    if cached.is_file():
        return cached
    failure = "downloading was disabled"
    if download:
        try:
            _download_weights(cached, timeout)
            return cached
        except OSError as error:  # no network, proxy page, timeout: the same advice
            failure = f"the download failed ({error})"
    raise FileNotFoundError(errno.ENOENT, f"InceptionV3 weights not found and {failure}; get {INCEPTION_WEIGHTS_URL} "
                            f"and put it here, set {INCEPTION_WEIGHTS_ENV}, or give --inception-weights", str(cached))


def _download_weights(destination: Path, timeout: float) -> None:
    """Download the published weights; a file whose SHA-256 is not theirs never reaches ``destination``."""
    digest = hashlib.sha256()
    with urllib.request.urlopen(INCEPTION_WEIGHTS_URL, timeout=timeout) as response, atomic_write(destination) as out:
        for chunk in iter(lambda: response.read(1 << 20), b""):
            out.write(chunk)
            digest.update(chunk)
        if not digest.hexdigest().startswith(INCEPTION_WEIGHTS_SHA256_PREFIX):
            raise OSError(f"the downloaded file's SHA-256 {digest.hexdigest()} is not the published weights'")


def load_inception(inception_weights: str | os.PathLike | None = None, *, download: bool = True
                   ) -> TFInceptionV3Features:
    """The ADM-comparable extractor, its weights found by :func:`resolve_inception_weights`."""
    return TFInceptionV3Features.from_file(resolve_inception_weights(inception_weights, download=download))


def random_inception_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights in torch-fidelity's layout, the same anywhere, for offline tests and demos.
    Convolutions are Kaiming-normal: with PyTorch's default init pool_3 collapses to nearly constant
    features (FID ~ 1e-13 between unrelated image sets). Batch norms are identities."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    class Unloaded(FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict, *args, **kwargs):  # the architecture only: weights drawn below
            pass

    model = _torch_fidelity(Unloaded, {}, ["2048"])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                fan_in = module.weight[0].numel()
                std = math.sqrt((2.0 if isinstance(module, nn.Conv2d) else 1.0) / fan_in)
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.BatchNorm2d):
                module.reset_parameters()
    return model.state_dict()


def build_random_inception(seed: int = 0) -> TFInceptionV3Features:
    """The TF-compatible InceptionV3 with :func:`random_inception_state_dict` weights; its numbers are
    NOT comparable to published ones, and its identity says so."""
    identity = f"tf-inception-v3-compat:RANDOM-kaiming-seed={seed}"
    return TFInceptionV3Features(random_inception_state_dict(seed), identity)


def save_random_inception_weights(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write :func:`random_inception_state_dict` where a weights file goes (loads like the real one)."""
    with atomic_write(path) as f:
        torch.save(random_inception_state_dict(seed), f)
    return Path(path)
