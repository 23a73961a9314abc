"""Class labels of a pipeline: the id -> name table and the search from names to ids.

Names are matched exactly first, then case-insensitively; a name may list synonyms separated by
commas (the long ImageNet names: ``"tench, Tinca tinca"``), each of which resolves. An unknown
name is answered with the closest known ones, an ambiguous one with every id it could mean.
"""

from __future__ import annotations

import difflib
import json
import numbers
from importlib import resources
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from moh_dit.errors import InvalidInput

__all__ = ["LabelIndex", "imagenet_id2label", "resolve_id2label"]


def imagenet_id2label() -> dict[int, str]:
    """The ImageNet-1k class names shipped in ``moh_dit.assets`` (id -> name)."""
    text = resources.files("moh_dit.assets").joinpath("imagenet1k_id2label.json").read_text(encoding="utf-8")
    return {int(k): v for k, v in json.loads(text).items()}


def resolve_id2label(id2label: dict[Any, str] | None, transformer_config) -> dict[int, str] | None:
    """The id -> name table of a pipeline: ``id2label`` checked against the model's classes, or
    by default the model's ``class_names``, else the ImageNet-1k names for a 1000-class model,
    else None."""
    num_classes = transformer_config.num_classes
    if id2label is None:
        names = getattr(transformer_config, "class_names", None)
        if names:
            return dict(enumerate(names))
        return imagenet_id2label() if num_classes == 1000 else None
    table = {}
    for key, name in id2label.items():
        try:
            class_id = int(key)
        except (TypeError, ValueError):
            raise InvalidInput(f"id2label keys must be class ids; got {key!r}.", parameters="id2label") from None
        if not 0 <= class_id < num_classes:
            raise InvalidInput(f"id2label has id {class_id}, outside [0, {num_classes - 1}] of this model.",
                               parameters="id2label")
        table[class_id] = str(name)
    return table


def _flatten(label: Any) -> Iterator[Any]:
    """The items of ``label`` in order, one level or many deep; a name or an id is one item."""
    if torch.is_tensor(label) or isinstance(label, np.ndarray):
        yield from label.reshape(-1).tolist()
    elif isinstance(label, (str, bytes)) or not isinstance(label, Iterable):
        yield label
    else:
        for item in label:
            yield from _flatten(item)


class LabelIndex:
    """Names (and their synonyms) -> class ids, for one id -> name table."""

    def __init__(self, id2label: dict[int, str]):
        self.id2label = dict(id2label)
        self._exact: dict[str, set[int]] = {}
        self._folded: dict[str, set[int]] = {}
        self._spelling: dict[str, str] = {}  # folded -> a spelling to suggest
        for class_id, name in self.id2label.items():
            for synonym in (s.strip() for s in name.split(",")):
                if synonym:
                    self._exact.setdefault(synonym, set()).add(class_id)
                    self._folded.setdefault(synonym.casefold(), set()).add(class_id)
                    self._spelling.setdefault(synonym.casefold(), synonym)

    @property
    def labels(self) -> dict[str, int]:
        """Every unambiguous name (and synonym) -> class id, sorted by name."""
        return {name: next(iter(ids)) for name, ids in sorted(self._exact.items()) if len(ids) == 1}

    def ids(self, label: str | int | Sequence[str | int], num_classes: int) -> list[int]:
        """Map names (case-insensitive) and/or class ids to class ids, validating each.

        Nested lists, tensors and arrays are flattened in order, as diffusers' DiTPipeline does
        (``[[1], [2]]`` is ``[1, 2]``). The null class id (``num_classes``) is accepted and gives
        unconditional samples. Raises InvalidInput (class_labels) for an unknown name (with close names), an
        ambiguous one, an id out of range, or an empty list.
        """
        label = list(_flatten(label))
        if not label:
            raise InvalidInput("class_labels is empty: pass at least one class id or name.", parameters="class_labels")
        ids = []
        for item in label:
            if isinstance(item, np.generic):
                item = item.item()
            if isinstance(item, str):
                ids.append(self.lookup(item, num_classes))
            elif isinstance(item, numbers.Integral) and not isinstance(item, bool):
                if not 0 <= int(item) <= num_classes:
                    raise InvalidInput(
                        f"class id {int(item)} is out of range: this model has classes 0..{num_classes - 1} "
                        f"(and {num_classes}, the null class, for unconditional samples).", parameters="class_labels",
                    )
                ids.append(int(item))
            else:
                raise InvalidInput(f"class labels must be int ids or names; got {item!r} ({type(item).__name__}).",
                                   parameters="class_labels")
        return ids

    def lookup(self, name: str, num_classes: int) -> int:
        """The class id of one name; ``num_classes`` only phrases the error of a table without names."""
        if not self._exact:
            raise InvalidInput(
                f"Class name {name!r} given but this pipeline has no class names (id2label); pass class ids "
                f"0..{num_classes - 1} or build the pipeline with id2label=...", parameters="class_labels",
            )
        key = name.strip()
        ids = self._exact.get(key) or self._folded.get(key.casefold())
        if not ids:
            close = difflib.get_close_matches(key.casefold(), list(self._folded), n=5, cutoff=0.6)
            hint = f" Did you mean: {', '.join(repr(self._spelling[c]) for c in close)}?" if close else ""
            raise InvalidInput(f"Unknown class name {name!r}.{hint} See `pipe.labels` for all names.",
                               parameters="class_labels")
        if len(ids) > 1:
            options = ", ".join(f"{i} ({self.id2label[i]!r})" for i in sorted(ids))
            raise InvalidInput(f"Class name {name!r} is ambiguous: {options}. Use the exact spelling or the id.",
                               parameters="class_labels")
        return next(iter(ids))
