"""Old import paths of the flat layout, kept working for one release.

The modules moved into subpackages by role (``moh_dit.models``, ``moh_dit.data``, ...).
``import moh_dit.presets`` (and ``from moh_dit.presets import get_preset``) still works: a
finder on ``sys.meta_path`` answers for each old name with the module at its new place, and
warns once with a ``DeprecationWarning`` that names the new path. ``moh_dit.data``,
``moh_dit.diffusion`` and ``moh_dit.sampling`` kept their names as packages, whose
``__init__`` re-exports what the old module held.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "install"]

# old module under moh_dit -> new module under moh_dit
MOVED: dict[str, str] = {
    "transformer_moh_dit": "models.transformer_moh_dit",
    "moh_routing": "models.attention",
    "sparse_attention": "models.sparse_attention",
    "head_layout": "models.layout",
    "head_activation": "models.head_activation",
    "presets": "models.presets",
    "flops": "models.flops",
    "latents": "data.latents",
    "demo_data": "data.demo_data",
    "classifier": "evaluation.classifier",
    "sweep": "sampling.sweep",
    "sweep_results": "sampling.sweep_results",
    "convert": "hub.convert",
    "upcycle": "hub.upcycle",
    "export": "hub.export",
    "bundle": "hub.bundle",
    "model_card": "hub.model_card",
    "io_utils": "utils.io",
    "output_folders": "utils.output_folders",
    "runtime": "utils.runtime",
    "cli": "utils.cli",
    "speed": "utils.speed",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.spec = module.__spec__  # importlib stamps the alias's spec on the module; put it back after
        return module

    def exec_module(self, module) -> None:  # the new module is already executed
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        package, _, leaf = fullname.rpartition(".")
        if package != __package__ or leaf not in MOVED:
            return None
        new = f"{__package__}.{MOVED[leaf]}"
        warnings.warn(f"{fullname} moved to {new}; the old path will be removed in the next release.",
                      DeprecationWarning, stacklevel=3)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
