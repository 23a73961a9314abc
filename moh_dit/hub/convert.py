"""Checkpoints of the MoH-DiT release, facebookresearch/DiT and diffusers' DiT -> ``MoHDiTTransformer2DModel``.

The release keeps facebookresearch/DiT's ``models.py`` keys (``x_embedder``, ``t_embedder``,
``y_embedder``, ``blocks.i.attn.qkv`` with q | k | v rows, ``adaLN_modulation``, ``final_layer``)
and adds each block's routers ``attn.wg`` / ``wg_0`` / ``wg_1``. Conversion is strict: every key
and shape must match the model the preset builds. Top-K cannot be read from weights (layers with
K=1 and K=2 have the same shapes), so the preset is always given.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
from pathlib import Path

import torch

from ..models import PRESETS, MoHDiTTransformer2DModel
from ..outputs import output_folder

__all__ = ["convert_checkpoint", "load_checkpoint", "model_to_release_state_dict", "release_state_dict_to_model",
           "diffusers_dit_state_dict_to_model"]

# release module -> model module; qkv is split into to_q / to_k / to_v separately.
_GLOBAL = {
    "x_embedder.proj": "pos_embed.proj",
    "t_embedder.mlp.0": "time_class_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_class_embed.timestep_embedder.linear_2",
    "y_embedder.embedding_table": "time_class_embed.class_embedder.embedding_table",
    "final_layer.linear": "proj_out_2",
    "final_layer.adaLN_modulation.1": "proj_out_1",
}
_BLOCK = {
    "attn.proj": "attn1.to_out.0",
    "attn.wg": "attn1.router_routed",
    "attn.wg_0": "attn1.router_mix",
    "attn.wg_1": "attn1.router_shared",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "adaLN_modulation.1": "norm1.linear",
}


def _names(model: MoHDiTTransformer2DModel) -> dict[str, str]:
    names = dict(_GLOBAL)
    for i in range(len(model.transformer_blocks)):
        names.update({f"blocks.{i}.{rel}": f"transformer_blocks.{i}.{ours}" for rel, ours in _BLOCK.items()})
    return names


def model_to_release_state_dict(model: MoHDiTTransformer2DModel) -> dict[str, torch.Tensor]:
    """The model's weights in the release's keys (with ``pos_embed``): the inverse of
    :func:`release_state_dict_to_model`, and a way to run the authors' code on weights trained here."""
    ours = model.state_dict()
    out = {"pos_embed": model.pos_embed.pos_embed.detach().clone()}
    for rel, mine in _names(model).items():
        out.update({f"{rel}.{s}": ours[f"{mine}.{s}"].clone() for s in ("weight", "bias") if f"{mine}.{s}" in ours})
    for i in range(len(model.transformer_blocks)):
        for s in ("weight", "bias"):
            out[f"blocks.{i}.attn.qkv.{s}"] = torch.cat([ours[f"transformer_blocks.{i}.attn1.to_{p}.{s}"]
                                                        for p in "qkv"])  # rows q | k | v, each head-major
    return out


def _check_keys(given: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """Every key and shape, or one ValueError naming each one that differs."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    shapes = [f"{k} {tuple(given[k].shape)} != {tuple(expected[k].shape)}" for k in sorted(set(given) & set(expected))
              if given[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        found = "; ".join(f"{title} ({len(keys)}): {', '.join(keys)}" for title, keys in
                          (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)) if keys)
        raise ValueError(f"{what} does not fit the model of this preset, sample_size and num_classes: {found}")


def _strip_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) prefixes."""
    for prefix in ("module.", "_orig_mod."):
        if state_dict and all(k.startswith(prefix) for k in state_dict):
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
    return state_dict


def release_state_dict_to_model(state_dict: dict[str, torch.Tensor], model: MoHDiTTransformer2DModel,
                                what: str = "the checkpoint") -> None:
    """Load a release / facebookresearch state dict into ``model``, strictly."""
    state_dict = _strip_prefix(dict(state_dict))
    expected = model_to_release_state_dict(model)
    _check_keys(state_dict, expected, what)
    # pos_embed is the fixed sin-cos table: a difference means another sample or patch size.
    gap = (state_dict["pos_embed"].float() - expected["pos_embed"].float()).abs().max().item()
    if gap > 1e-4:
        raise ValueError(f"{what}: pos_embed differs from the sin-cos table of this sample_size and patch size by "
                         f"{gap:.3g}; check sample_size and the preset's patch size")
    ours = {f"{mine}.{s}": state_dict[f"{rel}.{s}"] for rel, mine in _names(model).items() for s in ("weight", "bias")
            if f"{rel}.{s}" in state_dict}
    for i, block in enumerate(model.transformer_blocks):
        for s in ("weight", "bias"):
            qkv = state_dict[f"blocks.{i}.attn.qkv.{s}"].chunk(3)
            ours.update({f"transformer_blocks.{i}.attn1.to_{p}.{s}": v for p, v in zip("qkv", qkv)})
    model.load_state_dict(ours, strict=True)


def diffusers_dit_state_dict_to_model(state_dict: dict[str, torch.Tensor], model: MoHDiTTransformer2DModel,
                                      allow_divergent_embeddings: bool = False, what: str = "the checkpoint") -> None:
    """Load a diffusers ``DiTTransformer2DModel`` state dict into a dense ``model``.

    diffusers keeps a timestep and label embedder in every block; converted DiT checkpoints hold
    identical copies, which fold into the model's one. Copies that differ (a model fine-tuned in
    diffusers) are refused unless ``allow_divergent_embeddings``, which takes block 0's.
    """
    prefix = "transformer_blocks.0.norm1.emb."
    first = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    ours = {f"time_class_embed.{k}": v for k, v in first.items()}
    gap = 0.0
    for key, value in state_dict.items():
        if ".norm1.emb." in key:
            gap = max(gap, (value.float() - first[key.split(".norm1.emb.")[1]].float()).abs().max().item())
        else:
            ours[key] = value
    if gap > 0 and not allow_divergent_embeddings:
        raise ValueError(f"{what}: the per-block timestep/label embedders differ between blocks (by up to {gap:.3g}), "
                         "so folding them into one changes the model; allow_divergent_embeddings takes block 0's")
    _check_keys(ours, model.state_dict(), what)
    model.load_state_dict(ours, strict=True)


def _is_hub_id(source: str) -> bool:
    """Only ``org/name`` (no suffix, not starting with ``.``, ``/`` or ``~``) is looked up on the Hub."""
    return source.count("/") == 1 and not source.startswith((".", "/", "~")) and not Path(source).suffix


def _fetch(source: str) -> Path:
    """A local path, a URL (downloaded once to torch's hub cache, named by a hash of the whole URL) or a
    Hub id (``org/name``, snapshot-downloaded)."""
    path = Path(source).expanduser()
    if "://" in source:
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        path = Path(torch.hub.get_dir()) / "checkpoints" / f"{digest}-{Path(source.split('?')[0]).name}"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(source, str(path))  # through a temporary file: never half a checkpoint
        return path
    if not path.exists() and _is_hub_id(source):
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=["*.json", "transformer/*"]))
    if not path.exists():
        raise FileNotFoundError(2, "no such checkpoint file or folder", str(path))
    return path


def _load_file(path: Path) -> dict:
    """One weights file: safetensors, or a torch pickle read with ``weights_only`` (the release's holds an
    ``argparse.Namespace`` under ``args``: that class alone is allowed, nothing that could run code)."""
    if path.suffix == ".safetensors":
        from diffusers.models.model_loading_utils import load_state_dict

        return load_state_dict(str(path))  # its errors name the file
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated zip, a text file, a pickle of other classes: name the file
        lines = str(error).strip().splitlines() or [type(error).__name__]
        reason = next((line for line in lines if "Unsupported global" in line), lines[0])
        raise ValueError(f"{path} is not a readable torch checkpoint ({reason.strip().split('. ')[0]})") from None


def load_checkpoint(source: str | os.PathLike, weights: str = "ema") -> tuple[str, dict[str, torch.Tensor], dict]:
    """``(format, state_dict, config)`` of a checkpoint: ``"release"`` (the release's and
    facebookresearch's training pickles, their ``weights`` entry, or a bare state dict in their keys;
    config empty) or ``"diffusers"`` (a ``DiTTransformer2DModel`` folder or a pipeline folder holding one)."""
    path = _fetch(str(source))
    if path.is_dir():
        if (path / "transformer" / "config.json").is_file():
            path = path / "transformer"
        from diffusers import DiTTransformer2DModel

        config = DiTTransformer2DModel.load_config(path)  # its errors name the file
        if config.get("_class_name") != "DiTTransformer2DModel":
            raise ValueError(f"{path / 'config.json'} describes a {config.get('_class_name')}, not a "
                             "DiTTransformer2DModel; give a checkpoint file or a diffusers DiT folder")
        files = sorted(path.glob("diffusion_pytorch_model*.safetensors")) or sorted(path.glob("*.bin"))
        if not files:
            raise FileNotFoundError(2, "no diffusion_pytorch_model*.safetensors weights in the folder", str(path))
        state_dict = {}
        for file in files:
            state_dict.update(_load_file(file))
        return "diffusers", _strip_prefix(state_dict), config
    raw = _load_file(path)
    if "ema" in raw or "model" in raw:  # a training checkpoint: {"model", "ema", "opt", "args"}
        if weights not in raw:
            raise ValueError(f"{path} has no {weights!r} weights (it has {', '.join(map(str, raw))}); choose weights "
                             "that it has")
        raw = raw[weights]
    return "release", _strip_prefix({k: v for k, v in raw.items() if torch.is_tensor(v)}), {}


def convert_checkpoint(checkpoint: str | os.PathLike, preset: str, output_dir: str | os.PathLike | None = None, *,
                       weights: str = "ema", sample_size: int | None = None, num_classes: int | None = None,
                       overwrite: bool = False, allow_divergent_embeddings: bool = False) -> MoHDiTTransformer2DModel:
    """A release, facebookresearch or diffusers DiT checkpoint as ``preset``'s model (in eval mode).

    ``checkpoint``: a ``.pt`` / ``.pth`` / ``.safetensors`` file, a diffusers folder, a URL or a Hub id.
    ``weights``: which weights of a training checkpoint (``"ema"``, used for sampling, or ``"model"``).
    ``sample_size`` and ``num_classes`` default to the checkpoint's. With ``output_dir`` the model is
    saved there as a model folder (``save_pretrained``), published whole or not at all; an existing
    folder is replaced only with ``overwrite`` and only if ``moh-dit convert`` wrote it.
    """
    local = checkpoint if Path(checkpoint).expanduser().exists() else None
    with contextlib.nullcontext() if output_dir is None else output_folder(
            output_dir, "convert", overwrite=overwrite, inputs={"checkpoint": local}, publish=True) as folder:
        patch = PRESETS[preset]["patch_size"]
        fmt, state_dict, config = load_checkpoint(checkpoint, weights)
        if fmt == "release":
            if sample_size is None and "pos_embed" in state_dict:
                sample_size = round(state_dict["pos_embed"].shape[1] ** 0.5) * patch
            if num_classes is None and "y_embedder.embedding_table.weight" in state_dict:
                num_classes = state_dict["y_embedder.embedding_table.weight"].shape[0] - 1  # the last row: no class
        elif PRESETS[preset].get("num_shared_heads") is not None:
            raise ValueError(f"a diffusers DiTTransformer2DModel is a dense DiT; give a dense DiT preset, not {preset}")
        sizes = {"sample_size": sample_size or config.get("sample_size"),
                 "num_classes": num_classes or config.get("num_embeds_ada_norm")}
        model = MoHDiTTransformer2DModel.from_preset(preset, **{k: int(v) for k, v in sizes.items() if v})
        if fmt == "release":
            release_state_dict_to_model(state_dict, model, f"checkpoint {checkpoint}")
        else:
            diffusers_dit_state_dict_to_model(state_dict, model, allow_divergent_embeddings, f"checkpoint {checkpoint}")
        if folder is not None:
            model.save_pretrained(folder)
    return model.eval()
