"""Class accuracy of samples: how often a classifier sees the class a sample was made for (FID cannot
tell whether a model follows its labels). The classifier is a small CNN trained on real images, whose
held-out accuracy bounds the metric, or a torchvision ImageNet model (``"torchvision:resnet50"``)."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data import find_image_folder, load_image
from ..outputs import output_folder, write_json


class SmallCNN(nn.Module):
    """Three stages of two 3x3 convolutions (BatchNorm, ReLU) of widths w, 2w, 4w, 2x max-pooling
    between stages, global average pooling and a linear head."""

    def __init__(self, num_classes: int, width: int = 16) -> None:
        super().__init__()
        layers, channels = [], 3
        for stage, out in enumerate((width, 2 * width, 4 * width)):
            layers += [nn.MaxPool2d(2)] if stage else []
            for _ in range(2):
                layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
                channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))  # (N, 4w, H, W) -> (N, classes)


def resize_square(x: torch.Tensor, size: int) -> torch.Tensor:
    """Centre-crop float images (N, C, H, W) to a square and resize it to ``size`` (antialiased
    bilinear; nothing is resized at ``size`` already)."""
    h, w = x.shape[-2:]
    s = min(h, w)
    x = x[..., (h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
    return x if s == size else F.interpolate(x, size=(size, size), mode="bilinear", antialias=True)


class SampleClassifier:
    """uint8 RGB images (N, H, W, 3) -> class indices; ``classes`` names the outputs in order."""

    def __init__(self, model: nn.Module, preprocess: Callable[[torch.Tensor], torch.Tensor], classes: Sequence[str],
                 identity: str, held_out_accuracy: float | None = None) -> None:
        self.model, self.preprocess, self.classes = model.eval(), preprocess, list(classes)
        self.identity, self.held_out_accuracy = identity, held_out_accuracy

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(next(self.model.parameters()).device).permute(0, 3, 1, 2).float() / 255.0  # (N, 3, H, W)
        return self.model(self.preprocess(x)).argmax(dim=1).cpu()


# ----- training -------------------------------------------------------------------------------

def _split(samples: list[tuple[str, int]], num_classes: int, fraction: float, seed: int) -> tuple[list, list]:
    """Per class, a seeded ``fraction`` held out (at least one image of a class that has two)."""
    rng = np.random.default_rng(seed)
    train, held = [], []
    for label in range(num_classes):
        items = [s for s in samples if s[1] == label]
        order = rng.permutation(len(items))
        n_held = min(len(items) - 1, max(1, round(fraction * len(items)))) if len(items) > 1 else 0
        held += [items[i] for i in order[:n_held]]
        train += [items[i] for i in order[n_held:]]
    return train, held


def _load(items: list[tuple[str, int]], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    images = [resize_square(torch.from_numpy(np.array(load_image(path))).permute(2, 0, 1)[None].float() / 255.0, size)
              for path, _ in items]
    x = torch.cat(images) if images else torch.empty(0, 3, size, size)  # (N, 3, size, size) in [0, 1]
    return x * 2.0 - 1.0, torch.tensor([label for _, label in items], dtype=torch.long)


def _fit(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int, learning_rate: float,
         seed: int) -> None:
    """AdamW with a cosine schedule; random flips (as diffusion training) and shifts of up to 1/16 of the image."""
    from tqdm.auto import tqdm

    total = epochs * math.ceil(len(x) / batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    generator = torch.Generator().manual_seed(seed)
    shift = max(1, x.shape[-1] // 16)
    model.train()
    with tqdm(total=total, desc="classifier", disable=None) as bar:
        for _ in range(epochs):
            for idx in torch.randperm(len(x), generator=generator).split(batch_size):
                batch = x[idx]
                flip = torch.rand(len(batch), generator=generator) < 0.5
                batch = torch.where(flip[:, None, None, None], batch.flip(-1), batch)
                dy, dx = torch.randint(0, 2 * shift + 1, (2,), generator=generator).tolist()
                padded = F.pad(batch, (shift,) * 4, mode="replicate")
                batch = padded[..., dy:dy + batch.shape[-2], dx:dx + batch.shape[-1]]
                loss = F.cross_entropy(model(batch), y[idx])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    model.eval()


def train_classifier(data_dir: str | os.PathLike, output_dir: str | os.PathLike, *, image_size: int = 32,
                     epochs: int = 4, batch_size: int = 64, learning_rate: float = 3e-3,
                     held_out_fraction: float = 0.1, width: int = 16, seed: int = 0,
                     overwrite: bool = False) -> dict[str, Any]:
    """Train :class:`SmallCNN` on an image folder (one sub-folder per class) and write it to
    ``output_dir`` (``model.safetensors`` and ``classifier.json``, published whole). A seeded
    ``held_out_fraction`` of each class is kept out; the accuracy on it is recorded."""
    from safetensors.torch import save_file

    classes, _, samples = find_image_folder(data_dir)  # classes: the sorted folder names, as training takes them
    with output_folder(output_dir, "train-classifier", overwrite=overwrite, inputs={"data_dir": data_dir},
                       publish=True) as tmp:
        train_items, held_items = _split(samples, len(classes), held_out_fraction, seed)
        (x, y), (x_held, y_held) = _load(train_items, image_size), _load(held_items, image_size)
        torch.manual_seed(seed)
        model = SmallCNN(len(classes), width=width)
        _fit(model, x, y, epochs, batch_size, learning_rate, seed)
        with torch.no_grad():
            correct = torch.cat([model(part).argmax(1) for part in x_held.split(256)]) == y_held
        per_class = {classes[c]: correct[y_held == c].float().mean().item() for c in range(len(classes))
                     if (y_held == c).any()}
        record = {"architecture": "SmallCNN", "classes": classes, "width": width, "image_size": image_size,
                  "held_out": {"count": len(held_items), "accuracy": correct.float().mean().item() if len(correct)
                               else None, "per_class": per_class},
                  "train": {"count": len(train_items), "epochs": epochs, "learning_rate": learning_rate, "seed": seed}}
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / "model.safetensors")
        write_json(tmp / "classifier.json", record)
    return record


# ----- loading --------------------------------------------------------------------------------

def _torchvision(name: str, weights_file: str | os.PathLike | None) -> SampleClassifier:
    import torchvision

    weights = torchvision.models.get_model_weights(name).DEFAULT
    model = torchvision.models.get_model(name, weights=None)
    if weights_file is None:  # the torch hub cache, else a download
        state, source = weights.get_state_dict(progress=True, check_hash=True), weights.url
    else:
        state, source = torch.load(weights_file, map_location="cpu", weights_only=True), str(weights_file)
    model.load_state_dict(state)
    transform = weights.transforms()
    mean, std = torch.tensor(transform.mean).view(1, 3, 1, 1), torch.tensor(transform.std).view(1, 3, 1, 1)
    crop = int(transform.crop_size[0])

    def preprocess(x: torch.Tensor) -> torch.Tensor:
        return (resize_square(x, crop) - mean.to(x.device)) / std.to(x.device)

    return SampleClassifier(model, preprocess, weights.meta["categories"], f"torchvision:{name} ({source})")


def load_classifier(classifier: str | os.PathLike, classifier_weights: str | os.PathLike | None = None,
                    device: torch.device | str = "cpu") -> SampleClassifier:
    """A folder written by :func:`train_classifier`, or ``"torchvision:NAME"`` with ImageNet weights
    (``classifier_weights``: a local .pth / .safetensors state dict instead of the hub's)."""
    spec = os.fspath(classifier)
    if spec.startswith("torchvision:"):
        classifier = _torchvision(spec.removeprefix("torchvision:"), classifier_weights)
        classifier.model.to(device)
        return classifier
    from safetensors.torch import load_file

    path = Path(spec).expanduser()
    if not (path / "classifier.json").is_file():
        raise FileNotFoundError(errno.ENOENT, "not a classifier folder of moh-dit train-classifier (no "
                                "classifier.json); train one, or give torchvision:NAME", str(path))
    record = json.loads((path / "classifier.json").read_text(encoding="utf-8"))
    model = SmallCNN(len(record["classes"]), width=record["width"])
    model.load_state_dict(load_file(path / "model.safetensors"))
    size = record["image_size"]
    return SampleClassifier(model.to(device), lambda x: resize_square(x, size) * 2.0 - 1.0, record["classes"],
                            f"moh-dit-classifier:{path.resolve()}", record["held_out"]["accuracy"])


# ----- the metric -----------------------------------------------------------------------------

def read_sample_labels(samples: str | os.PathLike, labels: str | os.PathLike | None = None) -> np.ndarray:
    """Each sample's class: ``labels`` (a .npy), else ``arr_1`` of the samples .npz."""
    path = Path(labels if labels is not None else samples)
    if labels is not None:
        array = np.load(path, allow_pickle=False)
    elif path.suffix == ".npz" and "arr_1" in (data := np.load(path, allow_pickle=False)).files:
        with data:
            array = data["arr_1"]
    else:
        raise ValueError(f"{path}: no arr_1 (each sample's class, which moh-dit sample writes); give the labels "
                         "as a .npy (--labels)")
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer) or (len(array) and array.min() < 0):
        raise ValueError(f"{path}: labels must be a 1-D array of class indices >= 0, got {array.dtype} {array.shape}")
    return array.astype(np.int64)


def read_class_map(class_map: str | os.PathLike, classes: Sequence[str]) -> dict[int, int]:
    """Sample label -> classifier index from a JSON object whose values are indices, class names, or
    lists of names (Keras' ``imagenet_class_index.json``: ``{"0": ["n01440764", "tench"]}``)."""
    index = {name: i for i, name in enumerate(classes)}
    mapping = {}
    for key, value in json.loads(Path(class_map).read_text(encoding="utf-8")).items():
        names = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str) and v in index]
        target = index[names[-1]] if names else value
        if not isinstance(target, int) or not 0 <= target < len(classes):
            raise ValueError(f"{class_map}: label {key} maps to {value!r}, not one of the classifier's "
                             f"{len(classes)} classes")
        mapping[int(key)] = target
    return mapping


class ClassAccuracyMeter:
    """Predictions gathered batch by batch as images stream past (:func:`~.adm.extract_features`'s
    ``on_batch``); labels are mapped to classifier indices by ``class_map`` (else identity)."""

    def __init__(self, classifier: SampleClassifier, labels: Sequence[int], class_map: dict[int, int] | None = None,
                 count: int | None = None) -> None:
        labels = np.asarray(labels, dtype=np.int64)
        if count is not None and count != len(labels):
            raise ValueError(f"{len(labels)} labels for {count} samples; every sample needs its class label")
        targets = [class_map[label] if class_map is not None else label for label in labels.tolist()]
        if max(targets, default=0) >= len(classifier.classes):
            raise ValueError(f"label {max(targets)}, but the classifier has {len(classifier.classes)} classes; "
                             "give a class map (--class-index)")
        self.classifier, self.targets, self.predictions = classifier, np.array(targets, dtype=np.int64), []

    def update(self, images: torch.Tensor) -> None:
        self.predictions.append(self.classifier.predict(images).numpy())

    def result(self) -> dict[str, Any]:
        predictions = np.concatenate(self.predictions)
        if len(predictions) != len(self.targets):
            raise ValueError(f"{len(self.targets)} labels for {len(predictions)} samples; give one label per sample")
        correct = predictions == self.targets
        classifier = self.classifier
        per_class = {classifier.classes[t]: float(correct[self.targets == t].mean()) for t in np.unique(self.targets)}
        return {"class_accuracy": float(correct.mean()), "class_accuracy_per_class": per_class,
                "classifier": classifier.identity, "classifier_held_out_accuracy": classifier.held_out_accuracy}
