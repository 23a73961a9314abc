"""The data: image folders (``datasets``), the latent cache (``latents``) and the demo's shapes
(``demo_data``). Names load on first use, so a command's ``--help`` imports no torch."""

import importlib

_WHERE = {name: "datasets" for name in ("IMG_EXTENSIONS", "CorruptImageError", "ImageFolderDataset", "ResumableSampler",
                                         "center_crop_arr", "find_image_folder", "image_to_tensor", "load_image",
                                         "scan_image_files")}
_WHERE.update({name: "latents" for name in ("LatentDataset", "extract_latents", "load_vae")})
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
