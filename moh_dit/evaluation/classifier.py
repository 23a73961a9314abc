"""Classifiers that judge whether generated samples show the class they were asked for.

Two kinds, behind one interface (:class:`SampleClassifier`):

* a small CNN trained on the user's own real images (:func:`train_classifier`, or
  ``moh-dit train-classifier``). Its held-out accuracy on real images is recorded with
  its weights: it bounds what the class-consistency metric can show;
* any torchvision classification model by name (``"torchvision:resnet50"``) with its
  ImageNet weights, downloaded when a network is there or read from a local state-dict file.

Class indices follow the sorted class-folder names, as training and torchvision's
ImageFolder do, so a classifier trained on the training data agrees with the generator's
labels. A classifier folder holds ``model.safetensors``, ``classifier.json`` (architecture,
preprocessing, classes, held-out accuracy) and ``class_index.json`` (the class map).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from ..errors import DamagedFile, InputNotFound, InvalidInput
from ..data.datasets import center_crop_arr, find_image_folder, image_to_tensor, load_image, write_class_index
from ..hub.outputs import check_replaceable, naming_write_errors
from ..utils.io import publish_folder, write_json_atomic
from ..utils.output_folders import check_outside_inputs, hold_output_folder, write_output_marker
from ..utils.logging import get_logger
from ..utils.resources import check_fits_in_memory

__all__ = [
    "ClassifierNotFoundError",
    "SampleClassifier",
    "SmallCNN",
    "TrainedClassifier",
    "load_classifier",
    "train_classifier",
]

FORMAT = "moh-dit-classifier"
FORMAT_VERSION = 1
TORCHVISION_PREFIX = "torchvision:"
# What a classifier.json may say: far beyond any classifier train_classifier makes, and small
# enough that a width or class count typed into the file cannot ask for more memory than a
# machine has before the check against the weights runs.
MAX_CLASSES = 100_000
MAX_WIDTH = 4096
IMAGE_SIZE_RANGE = (8, 4096)

logger = get_logger(__name__)


class ClassifierNotFoundError(InputNotFound):
    """A classifier (folder, torchvision name or its weights) that cannot be found."""


class SmallCNN(nn.Module):
    """Three stages of two 3x3 convolutions (BatchNorm, ReLU), 2x max-pooling between
    stages, global average pooling and a linear head: widths ``w, 2w, 4w``. BatchNorm
    rather than GroupNorm: with it this small net converges in a few epochs."""

    def __init__(self, num_classes: int, width: int = 16, in_channels: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for stage, out in enumerate((width, 2 * width, 4 * width)):
            if stage:
                layers.append(nn.MaxPool2d(2))
            for _ in range(2):
                layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
                channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def _check_uint8_nhwc(images: torch.Tensor) -> None:
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected uint8 images of shape (N, H, W, 3), got {images.dtype} {tuple(images.shape)}")


def _resize_square(x: torch.Tensor, size: int) -> torch.Tensor:
    """Centre-crop float (N, C, H, W) to a square, then resize to ``size`` (antialiased bilinear)."""
    h, w = x.shape[-2:]
    s = min(h, w)
    x = x[..., (h - s) // 2 : (h - s) // 2 + s, (w - s) // 2 : (w - s) // 2 + s]
    if s != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x


class SampleClassifier:
    """A classifier of uint8 RGB images (N, H, W, 3) -> class indices.

    ``classes`` names the classifier's outputs in index order; ``identity`` says which
    classifier it is (it goes into the metrics JSON); ``held_out_accuracy`` is its accuracy
    on held-out real images when known.
    """

    def __init__(self, model: nn.Module, preprocess: Callable[[torch.Tensor], torch.Tensor], classes: Sequence[str],
                 identity: str, held_out_accuracy: float | None = None, classes_are_folders: bool = False) -> None:
        self.model = model.eval()
        self.classes_are_folders = classes_are_folders  # trained here: class names are the data's folder names
        self.preprocess = preprocess
        self.classes = list(classes)
        self.identity = identity
        self.held_out_accuracy = held_out_accuracy

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def to(self, device: torch.device | str) -> "SampleClassifier":
        self.model.to(device)
        return self

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Predicted class index of each image (a CPU int64 tensor)."""
        _check_uint8_nhwc(images)
        device = next(self.model.parameters()).device
        x = images.to(device).permute(0, 3, 1, 2).float().div(255.0)
        return self.model(self.preprocess(x)).argmax(dim=1).cpu()


# --------------------------------------------------------------------------------------
# Training a small CNN on real images
# --------------------------------------------------------------------------------------


@dataclass
class TrainedClassifier:
    path: Path
    classes: list[str]
    held_out_accuracy: float
    held_out_per_class: dict[str, float]
    num_train: int
    num_held_out: int
    seconds: float


def _split(samples: list[tuple[str, int]], num_classes: int, fraction: float, seed: int):
    """Per class, a seeded ``fraction`` of the images (at least one when a class has two) is held out."""
    rng = np.random.default_rng(seed)
    train, held = [], []
    for label in range(num_classes):
        items = [s for s in samples if s[1] == label]
        order = rng.permutation(len(items))
        n_held = min(len(items) - 1, max(1, round(fraction * len(items)))) if len(items) > 1 else 0
        held += [items[i] for i in order[:n_held]]
        train += [items[i] for i in order[n_held:]]
    return train, held


def _load_tensors(samples: list[tuple[str, int]], image_size: int, desc: str) -> tuple[torch.Tensor, torch.Tensor]:
    images = [image_to_tensor(center_crop_arr(load_image(path), image_size))
              for path, _ in tqdm(samples, desc=desc, leave=False, mininterval=1.0)]
    # No held-out images when every class has one image: an empty batch, accuracy unknown.
    x = torch.stack(images) if images else torch.empty(0, 3, image_size, image_size)
    return x, torch.tensor([label for _, label in samples], dtype=torch.long)


def _augment(x: torch.Tensor, generator: torch.Generator, shift: int) -> torch.Tensor:
    """Random horizontal flips (as diffusion training uses) and shifts of up to ``shift`` pixels."""
    flip = torch.rand(x.shape[0], generator=generator) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    if shift:
        h, w = x.shape[-2:]
        padded = F.pad(x, (shift, shift, shift, shift), mode="replicate")
        dy, dx = torch.randint(0, 2 * shift + 1, (2,), generator=generator).tolist()
        x = padded[..., dy : dy + h, dx : dx + w]
    return x


@torch.no_grad()
def _accuracy_per_class(model: nn.Module, x: torch.Tensor, y: torch.Tensor, classes: list[str]) -> tuple[float, dict[str, float]]:
    model.eval()
    pred = torch.cat([model(x[i : i + 256]).argmax(1) for i in range(0, len(x), 256)])
    correct = (pred == y).float()
    per_class = {classes[c]: float(correct[y == c].mean()) for c in range(len(classes)) if (y == c).any()}
    return float(correct.mean()), per_class


def _check_train_args(image_size: int, epochs: int, batch_size: int, learning_rate: float,
                      held_out_fraction: float, width: int, seed: int) -> None:
    for name, value, least in (("image_size", image_size, 8), ("epochs", epochs, 1), ("batch_size", batch_size, 1),
                               ("width", width, 1), ("seed", seed, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidInput(f"{name} must be an integer >= {least}, got {value!r}", parameters=name)
    if not (isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate) and learning_rate > 0):
        raise InvalidInput(f"learning_rate must be a positive finite number, got {learning_rate!r}",
                           parameters="learning_rate")
    if not (isinstance(held_out_fraction, (int, float)) and 0 < held_out_fraction < 1):
        raise InvalidInput(f"held_out_fraction must be in (0, 1), got {held_out_fraction!r}",
                           parameters="held_out_fraction")


def _is_classifier_folder(path: Path) -> bool:
    try:
        return json.loads((path / "classifier.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _fit(model: nn.Module, x_train: torch.Tensor, y_train: torch.Tensor, epochs: int, batch_size: int,
         learning_rate: float, seed: int, image_size: int) -> None:
    """AdamW with a cosine schedule, random flips and small shifts."""
    steps_per_epoch = math.ceil(len(x_train) / batch_size)
    total = epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    generator = torch.Generator().manual_seed(seed)
    shift = max(1, image_size // 16)
    with tqdm(total=total, desc="classifier", mininterval=1.0) as bar:
        for _ in range(epochs):
            model.train()
            order = torch.randperm(len(x_train), generator=generator)
            for i in range(0, len(order), batch_size):
                idx = order[i : i + batch_size]
                loss = F.cross_entropy(model(_augment(x_train[idx], generator, shift)), y_train[idx])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)


def _check_output_dir(output_dir: Path, overwrite: bool) -> None:
    check_replaceable(output_dir, overwrite, "train-classifier", _is_classifier_folder,
                      "a classifier folder (no classifier.json)")


def train_classifier(
    data_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    image_size: int = 32,
    epochs: int = 4,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    held_out_fraction: float = 0.1,
    width: int = 16,
    seed: int = 0,
    overwrite: bool = False,
    log: Callable[[str], None] | None = logger.info,
) -> TrainedClassifier:
    """Train :class:`SmallCNN` on an ImageFolder and save it to ``output_dir``.

    A seeded ``held_out_fraction`` of every class is kept out of training; the accuracy on
    those real images is printed and stored in ``classifier.json``. Images are centre-cropped
    and resized to ``image_size`` as diffusion training does (ADM's crop). Training uses AdamW
    with a cosine schedule, random flips and small shifts. The folder is written atomically;
    an existing one is replaced only with ``overwrite`` and only if it is a classifier folder.
    ``output_dir`` never lies inside ``data_dir`` (nor contains it), and the images must fit
    in memory; both are checked before any work.
    """
    _check_train_args(image_size, epochs, batch_size, learning_rate, held_out_fraction, width, seed)
    output_dir = Path(output_dir)
    _check_output_dir(output_dir, overwrite)
    check_outside_inputs(output_dir, {"data_dir": data_dir}, "output_dir")
    classes, class_to_idx, samples = find_image_folder(data_dir)
    if len(classes) < 2:
        raise InvalidInput(f"data_dir {data_dir}: a classifier needs at least two class folders, found {len(classes)}",
                           parameters="data_dir")
    check_fits_in_memory(len(samples) * 3 * image_size**2 * 4, f"image_size {image_size} for {len(samples)} images",
                         "use a smaller image_size, or fewer images", parameters="image_size")
    with hold_output_folder(output_dir, "train-classifier", "output_dir"):
        start = time.perf_counter()
        train_items, held_items = _split(samples, len(classes), held_out_fraction, seed)
        x_train, y_train = _load_tensors(train_items, image_size, "reading training images")
        x_held, y_held = _load_tensors(held_items, image_size, "reading held-out images")
        torch.manual_seed(seed)
        model = SmallCNN(len(classes), width=width)
        _fit(model, x_train, y_train, epochs, batch_size, learning_rate, seed, image_size)
        accuracy, per_class = (_accuracy_per_class(model, x_held, y_held, classes) if len(x_held)
                               else (float("nan"), {}))
        seconds = time.perf_counter() - start
        _check_output_dir(output_dir, overwrite)  # again: the folder may have appeared while training
        with naming_write_errors(output_dir), publish_folder(output_dir, replace=True) as tmp:
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / "model.safetensors")
            write_class_index(class_to_idx, tmp / "class_index.json")
            write_json_atomic(tmp / "classifier.json", {
                "format": FORMAT, "version": FORMAT_VERSION, "architecture": "SmallCNN",
                "num_classes": len(classes), "width": width, "in_channels": 3, "image_size": image_size,
                "classes": classes, "data_dir": str(Path(data_dir).resolve()),
                "held_out": {"fraction": held_out_fraction, "count": len(held_items), "accuracy": accuracy,
                             "per_class": per_class},
                "train": {"count": len(train_items), "epochs": epochs, "batch_size": batch_size,
                          "learning_rate": learning_rate, "seed": seed, "seconds": round(seconds, 1)},
            })
            write_output_marker(tmp, "train-classifier")
    if log is not None:
        log(f"classifier: {f'{100 * accuracy:.1f}%' if held_items else 'not measured (no image to hold out)'} on "
            f"{len(held_items)} held-out real images "
            f"({len(classes)} classes, {len(train_items)} training images, {seconds:.0f} s) -> {output_dir}")
    return TrainedClassifier(output_dir, classes, accuracy, per_class, len(train_items), len(held_items), seconds)


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


_RETRAIN = "restore the folder or train it again (moh-dit train-classifier)"


def _damaged(file: Path, problem: str) -> DamagedFile:
    return DamagedFile(f"classifier {file.parent}: {file.name} {problem}; it was edited or damaged: {_RETRAIN}",
                       parameters="classifier")


def _integer_field(meta: dict, file: Path, key: str, low: int, high: int) -> int:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _damaged(file, f"says {key} {value!r}, not an integer in [{low}, {high}]")
    return value


def _read_record(path: Path) -> dict[str, Any]:
    """``classifier.json``, checked field by field (and against ``class_index.json``) before
    anything is built from it."""
    file = path / "classifier.json"
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise _damaged(file, f"cannot be read as JSON ({type(error).__name__}: {error})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("architecture") != "SmallCNN":
        raise DamagedFile(f"classifier {path}: classifier.json is not a {FORMAT} SmallCNN record; {_RETRAIN}",
                          parameters="classifier")
    num_classes = _integer_field(meta, file, "num_classes", 1, MAX_CLASSES)
    _integer_field(meta, file, "width", 1, MAX_WIDTH)
    _integer_field(meta, file, "in_channels", 3, 3)  # samples are RGB
    _integer_field(meta, file, "image_size", *IMAGE_SIZE_RANGE)
    classes = meta.get("classes")
    if (not isinstance(classes, list) or len(classes) != num_classes or not all(isinstance(c, str) for c in classes)
            or len(set(classes)) != len(classes)):
        raise _damaged(file, f"does not list {num_classes} distinct class names (num_classes) under classes")
    held_out = meta.get("held_out", {})
    accuracy = held_out.get("accuracy") if isinstance(held_out, dict) else "missing"
    if accuracy is not None and (isinstance(accuracy, bool) or not isinstance(accuracy, (int, float))
                                 or not (math.isnan(accuracy) or 0 <= accuracy <= 1)):
        raise _damaged(file, f"says held_out accuracy {accuracy!r}, not a fraction in [0, 1]")
    index_file = path / "class_index.json"
    if index_file.exists():
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise _damaged(index_file, f"cannot be read as JSON ({type(error).__name__}: {error})") from None
        if index != {name: i for i, name in enumerate(classes)}:
            count = len(index) if isinstance(index, dict) else "no"
            raise _damaged(index_file, f"maps {count} classes, which do not match the {num_classes} classes of "
                                       "classifier.json in order")
    return meta


def _first_line(error: BaseException) -> str:
    """An error's reason in one short line (torch.load's and safetensors' messages run to paragraphs)."""
    text = str(error).strip()
    found = re.search(r"WeightsUnpickler error: ([^\n]+)", text)
    line = found.group(1) if found else (text.splitlines()[0].split(". ")[0] if text else "")
    return f"{type(error).__name__}: {line.rstrip('.')[:200]}"


def _weights_shapes(file: Path, parameter: str, advice: str = _RETRAIN) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a weights file's tensors, read from its header (nothing loaded)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
        raise DamagedFile(f"{parameter} {file} is not a readable .safetensors file ({_first_line(error)}); {advice}",
                          parameters=parameter) from None


def _check_shapes(given: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], file: Path,
                  parameter: str, advice: str) -> None:
    """The same tensor names with the same shapes, or one line naming the file and what differs."""
    # BatchNorm fills in a missing step counter (older torchvision weight files have none).
    missing = sorted(k for k in set(expected) - set(given) if not k.endswith("num_batches_tracked"))
    unexpected = sorted(set(given) - set(expected))
    wrong = [f"{k} {given[k]} instead of {expected[k]}" for k in sorted(set(given) & set(expected))
             if tuple(given[k]) != tuple(expected[k])]
    problems = ([f"missing {', '.join(missing[:3])}"] if missing else []) + \
               ([f"unexpected {', '.join(unexpected[:3])}"] if unexpected else []) + wrong[:3]
    if problems:
        raise InvalidInput(f"{parameter} {file} does not hold the weights of this model ({'; '.join(problems)}); "
                           f"{advice}", parameters=parameter)


def _load_folder(path: Path) -> SampleClassifier:
    if not (path / "classifier.json").is_file():
        raise ClassifierNotFoundError(
            f"classifier {path}: not a folder of moh-dit train-classifier (no classifier.json); make one with "
            "moh-dit train-classifier, or give torchvision:NAME", parameters="classifier")
    meta = _read_record(path)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ClassifierNotFoundError(f"classifier {path}: {weights.name} is missing; {_RETRAIN}",
                                      parameters="classifier")
    build = lambda: SmallCNN(meta["num_classes"], width=meta["width"], in_channels=meta["in_channels"])  # noqa: E731
    with torch.device("meta"):  # shapes only: nothing is allocated until they match the file
        expected = {k: tuple(v.shape) for k, v in build().state_dict().items()}
    _check_shapes(_weights_shapes(weights, "classifier"), expected, weights, "classifier",
                  f"classifier.json and {weights.name} come from different classifiers; {_RETRAIN}")
    model = build()
    model.load_state_dict(load_file(weights))
    size = meta["image_size"]

    def preprocess(x: torch.Tensor) -> torch.Tensor:
        return _resize_square(x, size) * 2.0 - 1.0

    return SampleClassifier(model, preprocess, meta["classes"], identity=f"moh-dit-classifier:{path.resolve()}",
                            held_out_accuracy=meta.get("held_out", {}).get("accuracy"), classes_are_folders=True)


def _torchvision_weights(name: str):
    import torchvision

    try:
        return torchvision.models.get_model_weights(name).DEFAULT
    except (ValueError, KeyError) as err:
        known = ", ".join(sorted(torchvision.models.list_models(module=torchvision.models))[:12])
        raise InvalidInput(f"classifier torchvision:{name}: not a torchvision classification model "
                           f"(e.g. {known}, ...)", parameters="classifier") from err


def _read_weights_file(file: Path, expected: dict[str, tuple[int, ...]], name: str) -> dict[str, torch.Tensor]:
    """``classifier_weights``: a .safetensors or torch state dict holding exactly the tensors of
    torchvision's ``name`` (shapes checked before loading a .safetensors file); one line naming
    the file otherwise."""
    parameter, advice = "classifier_weights", f"give the state dict of torchvision's {name} (.pth or .safetensors)"
    if not file.is_file():
        raise ClassifierNotFoundError(f"{parameter} {file}: no such file", parameters=parameter)
    if file.suffix == ".safetensors":
        _check_shapes(_weights_shapes(file, parameter, advice), expected, file, parameter, advice)
        return load_file(file)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - torch.load raises UnpicklingError, EOFError, RuntimeError, ...
        raise DamagedFile(f"{parameter} {file} is not a readable torch state dict (not a torch file, truncated, or "
                          f"holding objects other than tensors: {_first_line(error)}); {advice}",
                          parameters=parameter) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise InvalidInput(f"{parameter} {file} holds a {type(state).__name__}, not a state dict of tensors; {advice}",
                           parameters=parameter)
    _check_shapes({k: tuple(v.shape) for k, v in state.items()}, expected, file, parameter, advice)
    return state


def _load_torchvision(name: str, weights_file: str | os.PathLike | None) -> SampleClassifier:
    import torchvision

    weights = _torchvision_weights(name)
    model = torchvision.models.get_model(name, weights=None)
    if weights_file is not None:
        weights_file = Path(weights_file).expanduser()
        state = _read_weights_file(weights_file, {k: tuple(v.shape) for k, v in model.state_dict().items()}, name)
        source = str(weights_file)
    else:
        try:
            state = weights.get_state_dict(progress=True, check_hash=True)
        except OSError as err:  # URLError is an OSError: no network and nothing in the torch hub cache
            raise ClassifierNotFoundError(
                f"classifier torchvision:{name}: its ImageNet weights ({weights.url}) are not in the torch hub cache "
                f"({torch.hub.get_dir()}/checkpoints) and could not be downloaded ({err}); download them where a "
                "network is, and give the file as classifier_weights", parameters=("classifier", "classifier_weights")
            ) from err
        source = weights.url
    model.load_state_dict(state)
    categories = list(weights.meta.get("categories") or [])
    if len(categories) != weights.meta.get("num_classes", len(categories)) or not categories:
        categories = [str(i) for i in range(model.state_dict()[next(reversed(model.state_dict()))].shape[0])]
    transform = weights.transforms()
    mean = torch.tensor(transform.mean).view(1, 3, 1, 1)
    std = torch.tensor(transform.std).view(1, 3, 1, 1)
    crop = int(transform.crop_size[0])

    def preprocess(x: torch.Tensor) -> torch.Tensor:
        return (_resize_square(x, crop) - mean.to(x.device)) / std.to(x.device)

    return SampleClassifier(model, preprocess, categories, identity=f"torchvision:{name} ({source})")


def load_classifier(classifier: str | os.PathLike, classifier_weights: str | os.PathLike | None = None,
                    device: torch.device | str = "cpu") -> SampleClassifier:
    """``classifier`` is a folder written by :func:`train_classifier` or ``"torchvision:NAME"``.

    For torchvision models, ``classifier_weights`` is a local state-dict file (``.pth`` /
    ``.safetensors``); without it the ImageNet weights are taken from the torch hub cache or
    downloaded, and a clear error says what to do when neither works.
    """
    spec = os.fspath(classifier)
    if spec.startswith(TORCHVISION_PREFIX):
        name = spec[len(TORCHVISION_PREFIX):]
        if not name:
            raise InvalidInput("classifier torchvision: needs a model name, e.g. torchvision:resnet50",
                               parameters="classifier")
        return _load_torchvision(name, classifier_weights).to(device)
    if classifier_weights is not None:
        raise InvalidInput("classifier_weights is for torchvision:NAME classifiers; a classifier folder has its own",
                           parameters="classifier_weights")
    path = Path(spec).expanduser()
    if not path.exists():
        raise ClassifierNotFoundError(f"classifier {spec}: no such folder; give a folder from moh-dit "
                                      "train-classifier or torchvision:NAME", parameters="classifier")
    return _load_folder(path).to(device)


def describe(classifier: SampleClassifier) -> dict[str, Any]:
    """What goes into a metrics JSON about the classifier."""
    return {"classifier": classifier.identity, "classifier_num_classes": classifier.num_classes,
            "classifier_held_out_accuracy": classifier.held_out_accuracy}
