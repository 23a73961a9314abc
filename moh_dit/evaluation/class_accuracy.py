"""Class consistency of generated samples: how often a classifier sees the class they were made for.

The metric ("classification accuracy of generated samples") is the fraction of samples whose
predicted class is the class label they were generated with, overall and per class. It says
whether class conditioning works, which FID does not: a model that ignores its labels can
still match the reference distribution. It is bounded by the classifier's own accuracy on
real images, recorded with a classifier trained by ``moh-dit train-classifier``.

Sample labels follow ADM's convention for class-conditional samples: ``arr_1`` of the
samples ``.npz`` (what ``moh-dit sample`` writes), or a separate ``.npy``. A label is
mapped to the classifier's output index by a class map (:func:`read_class_map`); without one
label ``i`` is the classifier's class ``i`` (both follow the sorted class-folder order, and
ImageNet models use ImageNet's 1000 indices).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..errors import InputNotFound, InvalidInput
from .classifier import SampleClassifier
from .sources import zip_member_names

__all__ = ["ClassAccuracy", "ClassAccuracyMeter", "check_class_names", "class_accuracy", "read_class_map",
           "read_sample_labels", "sample_class_names", "sample_settings_file"]

# What moh-dit sample writes beside its images (moh_dit.sampling.sample_files.SETTINGS_FILE).
SAMPLE_SETTINGS_FILE = "sample_config.json"


@dataclass
class ClassAccuracy:
    overall: float
    per_class: dict[str, float]
    counts: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {"class_accuracy": self.overall, "class_accuracy_per_class": self.per_class,
                "class_accuracy_counts": self.counts}


def read_sample_labels(samples: str | os.PathLike | None, labels: str | os.PathLike | None) -> np.ndarray:
    """The samples' class labels: ``labels`` (a ``.npy``) if given, else ``arr_1`` of the samples ``.npz``."""
    if labels is not None:
        path = Path(labels)
        if not path.is_file():
            raise InputNotFound(f"labels {path}: no such file", parameters="labels")
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError as err:
            raise InvalidInput(f"labels {path}: not a .npy array of integers ({err})", parameters="labels") from err
        if isinstance(array, np.lib.npyio.NpzFile):
            array = array["arr_1" if "arr_1" in array.files else array.files[0]]
        where, parameter = f"labels {path}", "labels"
    else:
        path = Path(samples) if samples is not None else None
        if path is None or path.suffix != ".npz" or not path.is_file():
            raise InvalidInput("class accuracy needs the class label of each sample: give samples as an .npz with "
                               "arr_1 (moh-dit sample writes it), or labels as a .npy", parameters=("samples", "labels"))
        if "arr_1.npy" not in zip_member_names(path):
            raise InvalidInput(f"samples {path} has no arr_1 (each sample's class, which moh-dit sample writes); "
                               "give labels as a .npy", parameters=("samples", "labels"))
        with np.load(path, allow_pickle=False) as data:
            array = data["arr_1"]
        where, parameter = f"arr_1 of samples {path}", "samples"
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise InvalidInput(f"{where}: must be a 1-D integer array, got {array.dtype} {array.shape}",
                           parameters=parameter)
    if len(array) and array.min() < 0:
        raise InvalidInput(f"{where}: must be >= 0, found {int(array.min())}", parameters=parameter)
    return array.astype(np.int64)


def read_class_map(class_map: str | os.PathLike, classes: Sequence[str]) -> dict[int, int]:
    """Sample label -> classifier index from the JSON file ``class_map``.

    Values may be classifier indices or class names (names of ``classes``, the classifier's
    outputs); ``{"0": 7}``, ``{"0": "red_circle"}`` and the Keras ImageNet index
    ``{"0": ["n01440764", "tench"]}`` (the name is looked up, then the id) are all accepted.
    """
    path = Path(class_map)
    where = f"class_map {path}"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InvalidInput(f"{where}: cannot read it as JSON ({err})", parameters="class_map") from err
    if not isinstance(raw, dict):
        raise InvalidInput(f"{where}: expected a JSON object label -> class, got {type(raw).__name__}",
                           parameters="class_map")
    lookup = {name: i for i, name in enumerate(classes)}
    out: dict[int, int] = {}
    for key, value in raw.items():
        if not str(key).isdigit():
            raise InvalidInput(f"{where}: key {key!r} is not a sample label (a non-negative integer)",
                               parameters="class_map")
        candidates = value if isinstance(value, list) else [value]
        target = next((lookup[c] for c in candidates[::-1] if isinstance(c, str) and c in lookup), None)
        if target is None and isinstance(value, int) and not isinstance(value, bool):
            target = value
        if target is None or not 0 <= target < len(classes):
            raise InvalidInput(f"{where}: label {key} maps to {value!r}, which is not one of the "
                               f"classifier's {len(classes)} classes", parameters="class_map")
        out[int(key)] = target
    return out


def sample_settings_file(samples: str | os.PathLike) -> Path | None:
    """The ``sample_config.json`` of a sample set made by ``moh-dit sample``: beside its ``.npz``,
    in its output folder, or beside its ``samples/`` image folder; None when there is none."""
    path = Path(samples)
    for folder in ((path.parent,) if path.is_file() else (path, path.parent)):
        candidate = folder / SAMPLE_SETTINGS_FILE
        if candidate.is_file():
            return candidate
    return None


def sample_class_names(samples: str | os.PathLike) -> list[str] | None:
    """The class names of the model that made ``samples``, as ``moh-dit sample`` recorded them
    (``class_names`` of the transformer config in ``sample_config.json``); None when the samples
    do not say."""
    path = sample_settings_file(samples)
    if path is None:
        return None
    try:
        identity = json.loads(path.read_text(encoding="utf-8")).get("identity", {})
        names = identity.get("transformer_config", {}).get("class_names")
    except (OSError, ValueError, AttributeError) as error:
        raise ValueError(f"{path} is not a moh-dit sample settings file ({error}); it names the samples' classes, "
                         "so it is read for class accuracy. Repair or remove it.") from None
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"{path}: the transformer config's class_names is {names!r}, not a list of names")
    return names


def check_class_names(classifier: SampleClassifier, class_names: Sequence[str] | None) -> None:
    """Refuse a classifier trained on class folders whose classes are not ``class_names`` (the
    model's), in the same order: with label ``i`` taken as the classifier's class ``i`` the metric
    would compare different things. Nothing to check without names or for other classifiers."""
    if class_names is None or not classifier.classes_are_folders:
        return
    names = list(class_names)
    if names != classifier.classes[: len(names)]:
        shown = ", ".join(names[:4])
        theirs = ", ".join(classifier.classes[:4])
        raise ValueError(f"the model's classes ({shown}, ...) are not the classifier's ({theirs}, ...) in the "
                         "same order; train the classifier on the model's training data or give a class map")


class ClassAccuracyMeter:
    """Accumulates predictions batch by batch (so it can ride along a streamed evaluation).

    ``labels``: the class label of every sample, in order. ``class_map``: label -> classifier
    index (identity when None). ``class_names``: names of the sample labels, index = label
    (e.g. the generator's ``id2label``); per-class results are keyed by them, otherwise by the
    classifier's name of the mapped class. With identity mapping and ``class_names`` given, the
    classifier must have the same classes in the same order (else the metric would compare
    different things).
    """

    def __init__(self, classifier: SampleClassifier, labels: Sequence[int] | np.ndarray,
                 class_map: Mapping[int, int] | None = None, class_names: Sequence[str] | None = None) -> None:
        self.classifier = classifier
        self.labels = np.asarray(labels, dtype=np.int64)
        if self.labels.ndim != 1:
            raise ValueError(f"labels must be 1-D, got shape {self.labels.shape}")
        self.class_map = dict(class_map) if class_map is not None else None
        self.class_names = list(class_names) if class_names is not None else None
        if self.class_map is None:
            check_class_names(classifier, self.class_names)
        self.targets = np.array([self._target(int(label)) for label in self.labels], dtype=np.int64)
        self.predictions: list[np.ndarray] = []
        self.seen = 0

    def _target(self, label: int) -> int:
        if self.class_map is not None:
            if label not in self.class_map:
                raise InvalidInput(f"sample label {label} is not in class_map; add it there", parameters="class_map")
            return self.class_map[label]
        if label >= self.classifier.num_classes:
            raise InvalidInput(f"sample label {label} but the classifier has {self.classifier.num_classes} classes; "
                               "give class_map from labels to the classifier's classes", parameters="class_map")
        return label

    def update(self, images: torch.Tensor) -> None:
        n = images.shape[0]
        if self.seen + n > len(self.labels):
            raise ValueError(f"sample {len(self.labels)} has no label: {len(self.labels)} labels for more samples; "
                             "every sample needs its class label")
        self.predictions.append(self.classifier.predict(images).numpy())
        self.seen += n

    def _name(self, label: int) -> str:
        if self.class_names is not None and label < len(self.class_names):
            return self.class_names[label]
        return self.classifier.classes[self._target(label)]

    def result(self) -> ClassAccuracy:
        if self.seen != len(self.labels):
            raise ValueError(f"{len(self.labels)} labels but {self.seen} samples; give one label per sample")
        if not self.seen:
            raise ValueError("no samples to classify")
        correct = np.concatenate(self.predictions) == self.targets
        per_class, counts = {}, {}
        for label in np.unique(self.labels):
            name = self._name(int(label))
            mask = self.labels == label
            per_class[name] = float(correct[mask].mean())
            counts[name] = int(mask.sum())
        return ClassAccuracy(float(correct.mean()), per_class, counts)


@torch.no_grad()
def class_accuracy(classifier: SampleClassifier, images: Any, labels: Sequence[int] | np.ndarray,
                   class_map: Mapping[int, int] | None = None, class_names: Sequence[str] | None = None,
                   batch_size: int = 100) -> ClassAccuracy:
    """Class accuracy of ``images`` (anything ``open_image_source`` takes) generated for ``labels``."""
    from .sources import open_image_source

    source = open_image_source(images)
    if source.num_images is not None and source.num_images != len(labels):
        raise ValueError(f"{source.description}: {source.num_images} samples but {len(labels)} labels; "
                         "give one label per sample")
    meter = ClassAccuracyMeter(classifier, labels, class_map, class_names)
    for batch in source.batches(batch_size):
        meter.update(batch)
    return meter.result()
