"""The rules a ``MoHDiTTransformer2DModel`` config must obey, checked before the model is built.

A ``config.json`` with a size of zero, a negative one, or one the machine cannot hold would
otherwise fail deep inside the construction (a division by zero in the position embedding,
a negative tensor size, an allocation of terabytes) or, worse, only when the first image is
sampled. :func:`check_transformer_config` says in one line which field is wrong and why; the
model's ``__init__`` runs it on its arguments, and the loaders run it on ``config.json`` with
the file named (:func:`check_transformer_config_file`) before anything is built.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["ACTIVATION_VALUES", "check_transformer_config", "check_transformer_config_file", "training_step_bytes",
           "transformer_bytes"]

_POSITIVE = ("sample_size", "patch_size", "in_channels", "hidden_size", "num_layers", "attention_head_dim",
             "num_classes")
_DEFAULTS = {"sample_size": 32, "patch_size": 2, "in_channels": 4, "out_channels": None, "learn_sigma": True,
             "hidden_size": 1152, "num_layers": 28, "num_attention_heads": 16, "attention_head_dim": 72,
             "num_shared_heads": None, "top_k": None, "mlp_ratio": 4.0, "num_classes": 1000,
             "class_dropout_prob": 0.1, "norm_eps": 1e-6}


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _per_layer_ints(config: Mapping[str, Any], name: str, least: int, where: str) -> None:
    value = config.get(name, _DEFAULTS.get(name))
    if value is None and name != "num_attention_heads":
        return
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or not all(_is_int(v) and v >= least for v in values):
        raise ValueError(f"{where}{name} must be {'a positive integer' if least else 'an integer >= 0'} or a list "
                         f"of them (one per layer), got {value!r}.")


def _check_fields(config: Mapping[str, Any], where: str) -> None:
    def get(name: str) -> Any:
        return config.get(name, _DEFAULTS.get(name))

    for name in _POSITIVE:
        if not (_is_int(get(name)) and get(name) >= 1):
            raise ValueError(f"{where}{name} must be a positive integer, got {get(name)!r}.")
    out = get("out_channels")
    if out is not None and not (_is_int(out) and out >= 1):
        raise ValueError(f"{where}out_channels must be a positive integer (or null: from in_channels), got {out!r}.")
    _per_layer_ints(config, "num_attention_heads", 1, where)
    _per_layer_ints(config, "num_shared_heads", 0, where)
    _per_layer_ints(config, "top_k", 0, where)
    if get("sample_size") % get("patch_size"):
        raise ValueError(f"{where}sample_size={get('sample_size')} is not divisible by patch_size={get('patch_size')}.")
    if get("hidden_size") % 4:
        raise ValueError(f"{where}hidden_size={get('hidden_size')} must be divisible by 4 (the 2-D sine-cosine "
                         "position embedding splits it in four).")
    for name, low, high in (("mlp_ratio", 0.0, math.inf), ("norm_eps", 0.0, math.inf)):
        value = get(name)
        if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
                and low < value < high):
            raise ValueError(f"{where}{name} must be a finite number > 0, got {value!r}.")
    dropout = get("class_dropout_prob")
    if not (isinstance(dropout, numbers.Real) and not isinstance(dropout, bool) and 0 <= dropout <= 1):
        raise ValueError(f"{where}class_dropout_prob must be a number in [0, 1], got {dropout!r}.")
    if not isinstance(get("learn_sigma"), bool):
        raise ValueError(f"{where}learn_sigma must be true or false, got {get('learn_sigma')!r}.")


def transformer_bytes(config: Mapping[str, Any]) -> int:
    """About how many bytes the model of a (checked) ``config`` takes in float32: its parameters
    and the position-embedding buffer (which grows with the number of tokens)."""
    def get(name: str) -> Any:
        return config.get(name, _DEFAULTS.get(name))

    d, layers, p, size = get("hidden_size"), get("num_layers"), get("patch_size"), get("sample_size")
    heads = get("num_attention_heads")
    heads = list(heads) if isinstance(heads, (list, tuple)) else [heads] * layers
    out = get("out_channels") or get("in_channels") * (2 if get("learn_sigma") else 1)
    tokens = (size // p) ** 2
    mlp = int(d * float(get("mlp_ratio")))
    per_layer = sum(6 * d * d + 4 * d * h * get("attention_head_dim") + d * h + 2 * d * mlp for h in heads)
    total = (get("in_channels") * p * p * d + 3 * tokens * d + 256 * d + d * d + (get("num_classes") + 1) * d
             + per_layer + 2 * d * d + d * p * p * out)
    return 4 * total


# Activations a training step keeps for the backward pass, in float32 values per (image, token,
# layer, hidden unit): measured as the peak resident growth of a forward and backward on the CPU
# (about 26 for DiT-S/2 and MoH-DiT-S/2-75 at 256 tokens, 27-32 for MoH-DiT-Tiny at 16 tokens);
# the upper end, so the estimate errs towards refusing.
ACTIVATION_VALUES = 32


def training_step_bytes(config: Mapping[str, Any], batch: int) -> int:
    """About how many bytes one training step of ``batch`` images takes in float32 beyond the
    data: the activations kept for the backward pass (:data:`ACTIVATION_VALUES` per image,
    token, layer and hidden unit) and five copies of the weights (the model, its gradients,
    AdamW's two moments and the EMA)."""
    full = {**_DEFAULTS, **config}
    tokens = (full["sample_size"] // full["patch_size"]) ** 2
    activations = 4 * ACTIVATION_VALUES * batch * tokens * full["num_layers"] * full["hidden_size"]
    return activations + 5 * transformer_bytes(config)


def check_transformer_config(config: Mapping[str, Any], source: str | os.PathLike | None = None,
                             memory: bool = False) -> None:
    """Refuse a transformer config that cannot make a model, in one line naming the field (and
    ``source``, the ``config.json``, when given): sizes must be positive integers, ``sample_size``
    a multiple of ``patch_size``, ``hidden_size`` a multiple of 4, ratios and epsilons finite.
    With ``memory``, also a model too large for the machine's available memory."""
    where = f"{source}: " if source is not None else ""
    _check_fields(config, where)
    if memory:
        from ..utils.resources import check_fits_in_memory

        check_fits_in_memory(transformer_bytes(config), f"{where}the transformer (sample_size "
                             f"{config.get('sample_size')}, hidden_size {config.get('hidden_size')}, num_layers "
                             f"{config.get('num_layers')})", "check the sizes in config.json, or use a machine with "
                             "more memory")


def check_transformer_config_file(folder: str | os.PathLike) -> None:
    """:func:`check_transformer_config` (with the memory check) on ``folder/config.json``, a
    ``save_pretrained`` transformer folder; a file that is not a JSON object is refused too."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not a JSON text file ({error}); save the model again.") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); save the model again.") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds {type(config).__name__}, not a model config (a JSON object).")
    check_transformer_config(config, path, memory=True)
