"""Checkpoint conversion between the release / facebookresearch DiT format, diffusers'
``DiTTransformer2DModel`` and ``MoHDiTTransformer2DModel``.

All conversions are strict: every missing, unexpected or mis-shaped key is named in one
error, a preset that does not match the weights is refused, and nothing is written unless
the whole conversion succeeded (the output folder appears by an atomic rename).

The release key format is the one of facebookresearch/DiT's ``models.py`` (``x_embedder``,
``t_embedder``, ``y_embedder``, ``blocks.i.attn.qkv`` with q, k, v rows, ``adaLN_modulation``,
``final_layer``) plus, in the MoH-DiT release, each block's routers ``attn.wg`` / ``wg_0`` /
``wg_1``; docs/design.md section 3 lists the keys with their shapes. Top-K cannot be read from
weights (layers with K=1 and K=2 have the same shapes), so the preset is always required.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidInput
from ..utils.io import publish_folder
from ..utils.output_folders import check_folder_path, check_outside_inputs, hold_output_folder, write_output_marker
from .outputs import check_replaceable, local_path, naming_write_errors
from ..models.presets import PRESETS, get_preset
from ..models.transformer_moh_dit import MoHDiTTransformer2DModel

__all__ = [
    "ConversionError",
    "model_to_release_state_dict",
    "release_state_dict_to_model",
    "diffusers_dit_state_dict_to_model",
    "load_checkpoint_state_dict",
    "convert_checkpoint",
    "save_pretrained_atomic",
]


class ConversionError(InvalidInput):
    """The checkpoint does not match the requested preset or format."""


# What a checkpoint may be, for the errors that must say it.
ACCEPTED_FORMATS = (
    "a .pt/.pth torch checkpoint of the MoH-DiT release or facebookresearch/DiT (or a bare state dict in "
    "their key format), a .safetensors state dict, a diffusers DiTTransformer2DModel or DiTPipeline folder, "
    "a URL, or a Hub id (org/name)"
)
# A name ending in one of these is a file name, never a Hub id.
_FILE_SUFFIXES = {".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".pkl", ".pickle", ".npz", ".json", ".tar", ".zip"}


def _is_hub_id(source: str) -> bool:
    """Only ``org/name`` is tried on the Hub: exactly one slash, no leading ``.``, ``/`` or
    ``~``, no backslash and no file extension; anything else is a local path."""
    org, _, name = source.partition("/")
    return (
        source.count("/") == 1 and bool(org) and bool(name) and "\\" not in source
        and not source.startswith((".", "/", "~")) and Path(name).suffix.lower() not in _FILE_SUFFIXES
    )


def _one_line(err: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    lines = str(err).strip().splitlines()
    if not lines:
        return type(err).__name__
    first = lines[0].split(". ")[0].rstrip(".")  # loaders append paragraphs of advice
    return f"{type(err).__name__}: {first[:200]}"


# Keys of the release format that map one-to-one onto the model (qkv is split separately).
_GLOBAL_RELEASE_KEYS = {
    "x_embedder.proj": "pos_embed.proj",
    "t_embedder.mlp.0": "time_class_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_class_embed.timestep_embedder.linear_2",
    "y_embedder.embedding_table": "time_class_embed.class_embedder.embedding_table",
    "final_layer.linear": "proj_out_2",
    "final_layer.adaLN_modulation.1": "proj_out_1",
}
_BLOCK_RELEASE_KEYS = {
    "attn.proj": "attn1.to_out.0",
    "attn.wg": "attn1.router_routed",
    "attn.wg_0": "attn1.router_mix",
    "attn.wg_1": "attn1.router_shared",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "adaLN_modulation.1": "norm1.linear",
}


def _release_name_map(model: MoHDiTTransformer2DModel) -> dict[str, str]:
    """release module prefix -> model module prefix, for the modules this model has."""
    names = dict(_GLOBAL_RELEASE_KEYS)
    for i in range(len(model.transformer_blocks)):
        for rel, ours in _BLOCK_RELEASE_KEYS.items():
            names[f"blocks.{i}.{rel}"] = f"transformer_blocks.{i}.{ours}"
    return names


def model_to_release_state_dict(model: MoHDiTTransformer2DModel) -> dict[str, torch.Tensor]:
    """The model's weights in the release / facebookresearch DiT key format (with pos_embed).

    Useful to run the authors' sampling code on weights trained here, and as the exact
    inverse of ``release_state_dict_to_model`` for testing.
    """
    ours = model.state_dict()
    out: dict[str, torch.Tensor] = {"pos_embed": model.pos_embed.pos_embed.detach().clone()}
    for rel, mine in _release_name_map(model).items():
        for suffix in ("weight", "bias"):
            key = f"{mine}.{suffix}"
            if key in ours:
                out[f"{rel}.{suffix}"] = ours[key].clone()
    for i in range(len(model.transformer_blocks)):
        for suffix in ("weight", "bias"):
            prefix = f"transformer_blocks.{i}.attn1"
            out[f"blocks.{i}.attn.qkv.{suffix}"] = torch.cat(
                [ours[f"{prefix}.to_{p}.{suffix}"] for p in "qkv"], dim=0
            )  # rows q | k | v, each head-major
    return out


def _check_keys(
    given: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str, hint: str,
    parameters: tuple[str, ...],
) -> None:
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    mis_shaped = sorted(
        f"{k}: checkpoint {tuple(given[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(given) & set(expected)
        if tuple(given[k].shape) != tuple(expected[k].shape)
    )
    if missing or unexpected or mis_shaped:
        lines = [f"The {what} does not match the model built for it. {hint}"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mis_shaped)):
            if items:
                lines.append(f"  {title} ({len(items)}): " + "; ".join(items))
        raise ConversionError("\n".join(lines), parameters=parameters)


def _strip_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop DDP / torch.compile wrappers' key prefixes."""
    for prefix in ("module.", "_orig_mod."):
        if state_dict and all(k.startswith(prefix) for k in state_dict):
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
    return state_dict


def release_state_dict_to_model(
    state_dict: dict[str, torch.Tensor], model: MoHDiTTransformer2DModel, pos_embed_atol: float = 1e-4
) -> None:
    """Load a release / facebookresearch DiT state dict into ``model`` (strict)."""
    state_dict = _strip_prefix(dict(state_dict))
    expected = model_to_release_state_dict(model)
    _check_keys(
        state_dict, expected, "checkpoint",
        "Check preset (a MoH checkpoint needs a MoH one with the same per-layer heads), sample_size and num_classes.",
        ("preset", "sample_size", "num_classes"),
    )
    # pos_embed is a fixed sin-cos table; a mismatch means a wrong sample or patch size.
    diff = (state_dict["pos_embed"].float() - expected["pos_embed"].float()).abs().max().item()
    if diff > pos_embed_atol:
        raise ConversionError(
            f"The checkpoint's positional embedding differs from the sin-cos table of this config by {diff:.3g}; "
            "check sample_size and the patch size of preset.", parameters=("sample_size", "preset")
        )
    ours: dict[str, torch.Tensor] = {}
    for rel, mine in _release_name_map(model).items():
        for suffix in ("weight", "bias"):
            if f"{rel}.{suffix}" in state_dict:
                ours[f"{mine}.{suffix}"] = state_dict[f"{rel}.{suffix}"]
    for i, block in enumerate(model.transformer_blocks):
        inner = block.attn1.inner_dim
        for suffix in ("weight", "bias"):
            q, k, v = state_dict[f"blocks.{i}.attn.qkv.{suffix}"].split(inner, dim=0)
            for name, value in zip("qkv", (q, k, v)):
                ours[f"transformer_blocks.{i}.attn1.to_{name}.{suffix}"] = value
    model.load_state_dict(ours, strict=True)


def diffusers_dit_state_dict_to_model(
    state_dict: dict[str, torch.Tensor], model: MoHDiTTransformer2DModel, allow_divergent_embeddings: bool = False
) -> None:
    """Load a diffusers ``DiTTransformer2DModel`` state dict into a dense ``model``.

    diffusers keeps a timestep+label embedder in every block; they are folded into the
    model's single shared one. Converted facebookresearch checkpoints hold identical copies;
    if the copies differ (a model fine-tuned in diffusers), the conversion refuses unless
    ``allow_divergent_embeddings`` (then block 0's copy is used).
    """
    state_dict = _strip_prefix(dict(state_dict))
    emb_prefix = "transformer_blocks.{}.norm1.emb."
    first = {k[len(emb_prefix.format(0)):]: v for k, v in state_dict.items() if k.startswith(emb_prefix.format(0))}
    if not first:
        raise ConversionError(
            "No per-block embedder (transformer_blocks.0.norm1.emb.*) found: this is not a diffusers DiTTransformer2DModel state dict."
        )
    ours: dict[str, torch.Tensor] = {}
    worst = 0.0
    for key, value in state_dict.items():
        if ".norm1.emb." in key:
            block, rest = key.split(".norm1.emb.", 1)
            if rest in first:
                worst = max(worst, (value.float() - first[rest].float()).abs().max().item())
            continue
        ours[key] = value
    if worst > 0 and not allow_divergent_embeddings:
        raise ConversionError(
            f"The per-block timestep/label embedders differ between blocks (max difference {worst:.3g}); "
            "folding them into one changes the model. Set allow_divergent_embeddings to use block 0's copy.",
            parameters="allow_divergent_embeddings"
        )
    for rest, value in first.items():
        ours[f"time_class_embed.{rest}"] = value
    _check_keys(ours, model.state_dict(), "diffusers DiT state dict",
                "Check preset (a dense DiT one of the same size).", ("preset",))
    model.load_state_dict(ours, strict=True)


def _load_file_state_dict(path: Path) -> dict[str, Any]:
    """Read one weights file; an empty, truncated or foreign file is a ConversionError naming
    the file and what is accepted, not the loader's traceback (``EOFError``, ``KeyError``...)."""
    if path.stat().st_size == 0:
        raise ConversionError(f"{path} is empty (0 bytes). Expected {ACCEPTED_FORMATS}.")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except MemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise ConversionError(
                f"{path} is not a readable .safetensors file (truncated or corrupt? {_one_line(err)}). "
                f"Expected {ACCEPTED_FORMATS}."
            ) from None
    # The release pickles an argparse.Namespace under "args": allow exactly that class rather
    # than unpickling arbitrary objects with weights_only=False.
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if found:
            raise ConversionError(
                f"{path} is a pickle holding {found.group(1)}, not only tensors, dicts and argparse.Namespace; it is "
                f"not loaded, since unpickling other objects can run code. Expected {ACCEPTED_FORMATS}."
            ) from None
        reason = re.search(r"WeightsUnpickler error: ([^\n]+)", str(err))
        raise ConversionError(
            f"{path} is not a readable torch checkpoint (not a checkpoint, or corrupt: "
            f"{reason.group(1).rstrip('.') if reason else _one_line(err)}). "
            f"Expected {ACCEPTED_FORMATS}."
        ) from None
    except Exception as err:  # noqa: BLE001 - torch.load raises EOFError, KeyError, RuntimeError, ...
        raise ConversionError(
            f"{path} is not a readable torch checkpoint (truncated, corrupt or not a checkpoint: {_one_line(err)}). "
            f"Expected {ACCEPTED_FORMATS}."
        ) from None


def _fetch(source: str) -> Path:
    """A local path as is; a URL downloaded to the torch hub cache; a Hub id (``org/name``
    only) snapshot-downloaded. A path-like source that does not exist is a missing file."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    if source.startswith(("http://", "https://")):
        target = Path(torch.hub.get_dir()) / "checkpoints" / Path(source).name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                torch.hub.download_url_to_file(source, str(target))
            except Exception as err:  # noqa: BLE001 - network errors come in many types
                raise FileNotFoundError(f"Could not download checkpoint {source} ({_one_line(err)}).") from None
        return target
    if _is_hub_id(source):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(source, allow_patterns=["*.json", "transformer/*", "*.safetensors", "*.pt"]))
        except Exception as err:  # noqa: BLE001 - re-raised with the context users need
            raise FileNotFoundError(
                f"Checkpoint {source!r} is neither a local path (no such file or folder) nor fetchable from the Hub "
                f"({_one_line(err)})."
            ) from None
    raise FileNotFoundError(f"Checkpoint file {source} does not exist ({path.resolve()}). Expected {ACCEPTED_FORMATS}.")


def load_checkpoint_state_dict(source: str | os.PathLike, weights: str = "ema") -> tuple[str, dict[str, torch.Tensor], dict | None]:
    """Read a checkpoint and tell its format.

    Returns ``(format, state_dict, diffusers_config)`` with format ``"release"`` (the
    release's / facebookresearch's pickles, or a bare state dict in that key format) or
    ``"diffusers"`` (a ``DiTTransformer2DModel`` folder, or a pipeline folder holding one).
    """
    if weights not in ("ema", "model"):
        raise InvalidInput(f"weights {weights!r}: choose 'ema' (used for sampling) or 'model'.", parameters="weights")
    path = _fetch(str(source))
    if path.is_dir():
        if (path / "model_index.json").exists() and (path / "transformer").is_dir():
            path = path / "transformer"
        config_file = path / "config.json"
        if not config_file.exists():
            raise ConversionError(f"{path} is a folder without config.json. Expected {ACCEPTED_FORMATS}.")
        try:
            config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConversionError(f"{config_file} is not valid JSON ({_one_line(err)}).") from None
        if not isinstance(config, dict) or config.get("_class_name") != "DiTTransformer2DModel":
            raise ConversionError(f"{config_file} describes a {config.get('_class_name')!r}, not a DiTTransformer2DModel.")
        files = sorted(path.glob("diffusion_pytorch_model*.safetensors")) or sorted(path.glob("diffusion_pytorch_model*.bin"))
        if not files:
            raise ConversionError(f"No diffusion_pytorch_model*.safetensors/.bin weights in {path}.")
        state_dict: dict[str, torch.Tensor] = {}
        for file in files:
            state_dict.update(_load_file_state_dict(file))
        return "diffusers", state_dict, config
    raw = _load_file_state_dict(path)
    if not isinstance(raw, dict):
        raise ConversionError(f"{path} holds a {type(raw).__name__}, not a state dict or a training checkpoint dict.")
    if "ema" in raw or "model" in raw:
        if weights not in raw:
            raise ConversionError(
                f"{path} has no {weights!r} entry; its top-level keys are {sorted(raw)}: set weights to one it has.",
                parameters="weights")
        raw = raw[weights]
    state_dict = {k: v for k, v in raw.items() if torch.is_tensor(v)}
    if not state_dict:
        raise ConversionError(f"{path} contains no tensors.")
    return "release", _strip_prefix(state_dict), None


# A model folder as save_pretrained writes it: config.json and safetensors weights (possibly
# sharded, with their index); what moh-dit convert wrote before it marked its outputs.
_WEIGHT_FILE = re.compile(r"diffusion_pytorch_model(\.[\w-]+)?(-\d+-of-\d+)?\.safetensors(\.index\.json)?")
# Beside a model folder, these make it part of another output: a training run's final/, a
# pipeline's transformer/.
_OTHER_OWNERS = ("train_config.json", "model_index.json")


def is_model_folder(path: Path, extra: tuple[str, ...] = ()) -> bool:
    """Whether ``path`` holds a saved ``MoHDiTTransformer2DModel`` and nothing else (but the
    files named in ``extra``), and is not a training run's ``final/``: an output of
    ``moh-dit convert`` (or, with ``extra``, another writer) from before the output marker,
    when it is not part of a training run or a pipeline folder."""
    try:
        names = {p.name for p in path.iterdir()}
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    weights = {n for n in names if _WEIGHT_FILE.fullmatch(n)}
    return (isinstance(config, dict) and config.get("_class_name") == "MoHDiTTransformer2DModel"
            and bool(weights) and names - weights - {"config.json"} == set(extra)
            and not any((path.absolute().parent / name).is_file() for name in _OTHER_OWNERS))


def _check_output(output_dir: Path, overwrite: bool) -> None:
    """Refuse an output folder that is a file (or lies under one) whatever ``overwrite`` says, and
    an existing folder unless ``overwrite`` and it is empty, marked by moh-dit convert or an
    earlier conversion (:func:`is_model_folder`): nothing the user made is replaced."""
    check_folder_path(output_dir, "output_dir", "give a folder path", error=FileExistsError)
    check_replaceable(output_dir, overwrite, "convert", is_model_folder,
                      "an earlier conversion (a saved MoHDiTTransformer2DModel folder)", "output_dir")


def save_pretrained_atomic(model: MoHDiTTransformer2DModel, output_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """``save_pretrained`` into a temporary sibling folder, marked as moh-dit convert's output,
    then rename it into place; a folder it replaces is deleted only after the new one is in.
    A failed write (disk full, ...) is an OSError naming ``output_dir``."""
    output_dir = Path(output_dir)
    _check_output(output_dir, overwrite)
    with naming_write_errors(output_dir), publish_folder(output_dir, replace=True) as tmp:  # refused above if not ours
        model.save_pretrained(tmp, safe_serialization=True)
        write_output_marker(tmp, "convert")
    return output_dir


def convert_checkpoint(
    checkpoint: str | os.PathLike,
    preset: str,
    output_dir: str | os.PathLike | None = None,
    weights: str = "ema",
    sample_size: int | None = None,
    num_classes: int | None = None,
    overwrite: bool = False,
    allow_divergent_embeddings: bool = False,
) -> MoHDiTTransformer2DModel:
    """Convert a release / facebookresearch / diffusers DiT checkpoint into ``preset``.

    ``sample_size`` and ``num_classes`` default to what the checkpoint says (pos_embed length
    and embedding rows, or the diffusers config). The model is saved to ``output_dir`` with
    ``save_pretrained`` when given; returned either way.
    """
    if preset not in PRESETS:
        raise InvalidInput(f"preset {preset!r} is unknown; choose one of {', '.join(PRESETS)}.", parameters="preset")
    config = get_preset(preset)
    patch = config["patch_size"]
    for name, value in (("sample_size", sample_size), ("num_classes", num_classes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidInput(f"{name} must be an int >= 1, got {value!r}; leave it out to read it from the "
                               "checkpoint.", parameters=name)
    if sample_size is not None and sample_size % patch:
        raise InvalidInput(f"sample_size {sample_size} is not a multiple of the patch size {patch} of {preset}.",
                           parameters="sample_size")
    if output_dir is None:
        return _convert(checkpoint, preset, config, weights, sample_size, num_classes, allow_divergent_embeddings)
    output_dir = Path(output_dir)
    _check_output(output_dir, overwrite)  # before the (slow) load: nothing is read for a refused output_dir
    check_outside_inputs(output_dir, {"checkpoint": local_path(checkpoint)}, "output_dir")
    with hold_output_folder(output_dir, "convert", "output_dir"):
        model = _convert(checkpoint, preset, config, weights, sample_size, num_classes, allow_divergent_embeddings)
        save_pretrained_atomic(model, output_dir, overwrite=overwrite)
    return model


def _convert(checkpoint: str | os.PathLike, preset: str, config: dict[str, Any], weights: str,
             sample_size: int | None, num_classes: int | None, allow_divergent_embeddings: bool
             ) -> MoHDiTTransformer2DModel:
    """The checked arguments of :func:`convert_checkpoint` -> the converted model (in eval mode)."""
    patch = config["patch_size"]
    fmt, state_dict, dconfig = load_checkpoint_state_dict(checkpoint, weights)
    if fmt == "release":
        if "pos_embed" in state_dict and sample_size is None:
            sample_size = int(round(state_dict["pos_embed"].shape[1] ** 0.5)) * patch
        table = state_dict.get("y_embedder.embedding_table.weight")
        if table is not None and num_classes is None:
            num_classes = table.shape[0] - 1
    else:
        if config.get("num_shared_heads") is not None:
            raise ConversionError(f"A diffusers DiTTransformer2DModel is a dense DiT; give a dense one as preset, "
                                  f"not {preset!r}.", parameters="preset")
        sample_size = sample_size or dconfig.get("sample_size")
        num_classes = num_classes or dconfig.get("num_embeds_ada_norm")
    if sample_size is not None:
        config["sample_size"] = int(sample_size)
    if num_classes is not None:
        config["num_classes"] = int(num_classes)
    model = MoHDiTTransformer2DModel(**config)
    if fmt == "release":
        release_state_dict_to_model(state_dict, model)
    else:
        diffusers_dit_state_dict_to_model(state_dict, model, allow_divergent_embeddings)
    return model.eval()
