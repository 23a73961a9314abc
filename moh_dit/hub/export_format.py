"""The format of pipeline folders that name their pipeline's module file, and reading one with
the package's own classes.

:mod:`moh_dit.hub.export` writes a folder whose ``model_index.json`` names module files that
travel with it (``_class_name: [PIPELINE_MODULE, class]``, ``transformer: [TRANSFORMER_MODULE,
class]``), so that ``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` loads it
without moh-dit. ``MoHDiTPipeline.save_pretrained`` names a module file too: a few lines
(:func:`write_loader_file`) that import the pipeline from the installed package, because
``DiffusionPipeline.from_pretrained`` looks a plain class name up in ``diffusers`` itself and the
module-file entry is its only way to a pipeline class from elsewhere. With moh-dit installed,
``MoHDiTPipeline.from_pretrained(folder)`` loads either kind of folder through
:func:`load_export_components` and runs none of the folder's files.

This module is kept apart from the writer because the pipeline imports it (and so it travels
inside the pipeline's own module file), while the writer imports the pipeline.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from diffusers.models import AutoencoderKL
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from ..models.transformer_moh_dit import MoHDiTTransformer2DModel

__all__ = ["PIPELINE_MODULE", "TRANSFORMER_MODULE", "read_export_index", "load_export_components", "write_loader_file"]

PIPELINE_MODULE = "pipeline_moh_dit"
TRANSFORMER_MODULE = "transformer_moh_dit"
_INDEX_FILE = "model_index.json"
# What MoHDiTPipeline.from_pretrained takes for an export; the rest needs diffusers' own loader.
_COMPONENTS = ("transformer", "scheduler", "vae", "id2label")
# One string per source line, so that no line of this module (which travels inside exported pipeline
# files, whose imports diffusers checks line by line) reads as an import of the package.
_LOADER = (
    '"""Points diffusers at moh-dit\'s {name}, which this folder was saved from:\n'
    "DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) loads it with moh-dit installed\n"
    '(MoHDiTPipeline.from_pretrained(folder) needs no trust_remote_code)."""\n\n'
    "try:\n"
    "    from moh_dit.pipelines.pipeline_moh_dit import {name}\n"
    "except ImportError as error:\n"
    "    raise ImportError(\"This folder was saved by moh-dit's {name}: install moh-dit (pip install . in a clone of its repository), \"\n"
    "                      \"or share it with `moh-dit export`, which writes a folder that carries its own code.\") from error\n\n"
    '__all__ = ["{name}"]\n'
)


def read_export_index(path: str | os.PathLike) -> dict[str, Any] | None:
    """``path``'s ``model_index.json`` if ``path`` is an exported folder (its ``_class_name``
    names a module file), else None (a plain ``save_pretrained`` folder, a Hub id, ...)."""
    index_file = Path(path) / _INDEX_FILE
    index = json.loads(index_file.read_text(encoding="utf-8")) if index_file.is_file() else {}
    return index if isinstance(index.get("_class_name"), list) else None


def load_export_components(path: str | os.PathLike, index: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The pipeline's constructor arguments for the exported folder ``path`` (whose
    ``model_index.json`` is ``index``), loaded with the package's classes.

    ``kwargs`` are ``from_pretrained``'s: ``torch_dtype`` (or ``dtype``), ``variant`` and ready
    ``transformer`` / ``scheduler`` / ``vae`` / ``id2label``; any other raises TypeError.
    """
    folder = Path(path)
    kwargs = dict(kwargs)
    dtype = kwargs.pop("torch_dtype", None)
    weights = dict(torch_dtype=kwargs.pop("dtype", dtype), variant=kwargs.pop("variant", None))
    parts = {name: kwargs.pop(name) for name in _COMPONENTS if name in kwargs}
    if kwargs:
        raise TypeError(f"MoHDiTPipeline.from_pretrained({str(folder)!r}) of a folder that names its pipeline module does not take "
                        f"{sorted(kwargs)}; use DiffusionPipeline.from_pretrained(folder, trust_remote_code=True, ...).")
    if "transformer" not in parts:
        parts["transformer"] = MoHDiTTransformer2DModel.from_pretrained(folder / "transformer", **weights)
    if "scheduler" not in parts:
        library, name = index["scheduler"]
        scheduler_cls = getattr(importlib.import_module("diffusers"), name, None) if library == "diffusers" else None
        if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, SchedulerMixin)):
            raise ValueError(f"{folder / _INDEX_FILE} names the scheduler {library}.{name}, which is not a diffusers "
                             "scheduler.")
        parts["scheduler"] = scheduler_cls.from_pretrained(folder / "scheduler")
    if "vae" not in parts:
        parts["vae"] = AutoencoderKL.from_pretrained(folder / "vae", **weights) if index.get("vae", [None])[0] else None
    return {"id2label": index.get("id2label"), **parts}


def write_loader_file(folder: str | os.PathLike, class_name: str) -> None:
    """Make a ``save_pretrained`` folder loadable by ``DiffusionPipeline.from_pretrained``: a
    ``PIPELINE_MODULE.py`` that imports ``class_name`` from the installed package, named in
    ``model_index.json`` as ``_class_name: [PIPELINE_MODULE, class_name]``."""
    folder = Path(folder)
    (folder / f"{PIPELINE_MODULE}.py").write_text(_LOADER.format(name=class_name), encoding="utf-8")
    index_file = folder / _INDEX_FILE
    index = json.loads(index_file.read_text(encoding="utf-8"))
    index["_class_name"] = [PIPELINE_MODULE, class_name]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
