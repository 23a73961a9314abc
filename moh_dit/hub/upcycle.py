"""Upcycling: a dense DiT becomes a MoH-DiT that keeps every dense weight (docs/upcycling.md).

Reading order: where the dense model comes from (``load_dense``), which layout it gets
(``resolve_layout``: an upcycled preset's, the upcycling rule's for any other ratio
(``moh_dit.models.layout.upcycle_layout``), or the given lists), the calibration inputs
(``calibration_batches``), head importance by ablation (``head_importance``), the choice of
shared heads (``choose_heads``), the weight transfer (``transfer_weights``), the first-forward
check (``dense_forward_with_head_mask``, ``first_forward_gap``), and ``upcycle`` /
``save_upcycled`` which put them together.

Every layer keeps the dense head count. Per layer the ``hs`` most important heads (output
change when the head is removed, measured on calibration data) become the shared heads, the
others the routed ones; heads are reordered inside the QKV and output projections (shared
first, as the model expects), which leaves the dense function unchanged. All routers start
at zero: equal scores make every release gate exactly 1 (``hs * softmax(0) = 1``,
``K * p / sum_topK p = 1``, ``2 * softmax(0) = 1``), so the first forward is the dense model
with each token's unselected routed heads removed and every kept head at its dense scale.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import InputNotFound, InvalidInput
from .convert import convert_checkpoint, is_model_folder
from .outputs import check_replaceable, naming_write_errors
from ..diffusion.gaussian_diffusion import create_diffusion
from ..utils.io import publish_folder, write_json_atomic
from ..utils.output_folders import check_folder_path, write_output_marker
from ..models.attention import MoHAttnProcessor, MoHRouting
from ..models.layout import HeadLayout, upcycle_layout
from ..models.presets import PRESETS, UPCYCLED_PRESETS
from ..models.transformer_moh_dit import MoHDiTTransformer2DModel

__all__ = ["LayerChoice", "UpcycleReport", "load_dense", "resolve_layout", "calibration_batches", "head_importance",
           "choose_heads", "transfer_weights", "dense_forward_with_head_mask", "routing_head_masks",
           "first_forward_gap", "upcycle", "check_output", "is_upcycled_folder", "save_upcycled", "REPORT_FILE"]

REPORT_FILE = "upcycle_report.json"
# The architecture keys that must match for an upcycled preset to fit a dense model.
_ARCH_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "attention_head_dim", "patch_size", "mlp_ratio",
              "learn_sigma")


@dataclass
class LayerChoice:
    """What one layer became. Head numbers are the dense model's; ``order`` is the dense head
    at each position of the upcycled layer (shared first, then routed)."""

    layer: int
    heads: int
    shared: list[int]
    routed: list[int]
    top_k: int
    importance: list[float] | None  # per dense head (relative output change when removed); None if not measured
    first_selected: list[int] | None = None  # routed heads some token selected in the first-forward check

    @property
    def order(self) -> list[int]:
        return self.shared + self.routed


@dataclass
class UpcycleReport:
    """Per-layer choices and how they were made, saved as ``upcycle_report.json``."""

    source: str
    preset: str | None  # the upcycled preset whose layout this is, if any
    activation: float  # realised: sum (hs + K) / sum h
    calibration: str
    calibration_images: int
    layers: list[LayerChoice]
    first_forward_max_abs_diff: float | None = None  # vs the dense model with unselected heads removed
    notes: list[str] = field(default_factory=list)
    requested_activation: float | None = None  # activation; None when the layout was given per layer

    def table(self) -> str:
        """One line per layer: heads, shared / routed (dense head numbers), top-K, importance."""
        active = sum(len(c.shared) + c.top_k for c in self.layers)
        total = sum(c.heads for c in self.layers)
        layout = self.preset or ("custom layout" if self.requested_activation is None else "the upcycling rule's layout")
        asked = "" if self.requested_activation is None else f"requested {self.requested_activation:g}, "
        lines = [f"upcycled from {self.source} -> {layout} (head activation {asked}realised {active}/{total} = "
                 f"{self.activation:.4f}); shared heads chosen by {self.calibration}"]
        for c in self.layers:
            imp = "not measured" if c.importance is None else " ".join(f"{i}:{v:.3g}" for i, v in
                                                                        enumerate(c.importance))
            first = f" (first forward selects {c.first_selected})" if c.routed and c.first_selected is not None else ""
            lines.append(f"layer {c.layer:2d}: {c.heads} heads, shared {c.shared}, routed {c.routed}, top-K {c.top_k}"
                         f"{first}; importance {imp}")
        if self.first_forward_max_abs_diff is not None:
            lines.append(f"first forward vs dense with unselected heads removed: max |diff| "
                         f"{self.first_forward_max_abs_diff:.3g}")
        lines.extend(self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "layers": [{**asdict(c), "order": c.order} for c in self.layers]}


# --------------------------------------------------------------------------------------
# The dense model and the layout
# --------------------------------------------------------------------------------------


def load_dense(source: Any, preset: str | None = None, weights: str = "ema", sample_size: int | None = None,
               num_classes: int | None = None) -> tuple[MoHDiTTransformer2DModel, str]:
    """The dense model and a name for it: a dense ``MoHDiTTransformer2DModel``, a folder it was
    saved to (``save_pretrained``, e.g. a training run's ``final``, or a pipeline folder holding
    one as ``transformer/``), or anything
    ``moh_dit.hub.convert.convert_checkpoint`` reads for the dense ``preset``."""
    if isinstance(source, MoHDiTTransformer2DModel):
        model, name = source, "the given model"
    else:
        folder = _model_folder(source)
        if folder is not None:
            model = MoHDiTTransformer2DModel.from_pretrained(folder[0])
        else:
            if preset is None:
                raise InvalidInput(f"{source} needs preset, its dense DiT layout (e.g. DiT-XL/2); only a saved "
                                   "MoHDiTTransformer2DModel folder names its own layout.", parameters="preset")
            if preset not in PRESETS or PRESETS[preset].get("num_shared_heads") is not None:
                dense = [n for n, c in PRESETS.items() if c.get("num_shared_heads") is None]
                raise InvalidInput(f"preset {preset!r} is not a dense DiT; choose one of {', '.join(dense)}.",
                                   parameters="preset")
            model = convert_checkpoint(source, preset, weights=weights, sample_size=sample_size,
                                       num_classes=num_classes)
        name = str(source)
    if model.is_moh:
        raise ValueError(f"{name} is already a MoH model (it has routers); upcycling starts from a dense DiT.")
    return model.eval(), name


def _model_folder(source: Any) -> tuple[Path, dict] | None:
    """``(folder, config)`` where ``source`` is a saved ``MoHDiTTransformer2DModel`` folder or a
    pipeline folder holding one as ``transformer/``; None for anything else."""
    path = Path(str(source)).expanduser()
    if (path / "model_index.json").is_file() and (path / "transformer" / "config.json").is_file():
        path = path / "transformer"  # a pipeline folder
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return None
    try:
        values = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return (path, values) if isinstance(values, dict) and values.get("_class_name") == "MoHDiTTransformer2DModel" \
        else None


def _source_heads(source: Any, preset: str | None) -> list[int] | None:
    """The dense model's heads per layer, read without loading its weights (a model, a saved
    folder's config, or the dense ``preset`` of a checkpoint); None where that is not possible
    (then ``load_dense`` says why) or the source is not dense."""
    try:
        if isinstance(source, MoHDiTTransformer2DModel):
            layout = source.layout
        elif (folder := _model_folder(source)) is not None:
            layout = HeadLayout.of_config(folder[1])
        elif preset in PRESETS:
            layout = HeadLayout.of_config(PRESETS[preset])
        else:
            return None
    except (KeyError, TypeError, ValueError):
        return None
    return None if layout.is_moh else list(layout.heads)


def _per_layer(value: int | Sequence[int], layers: int, name: str) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * layers
    values = [int(v) for v in value]
    if len(values) != layers:
        raise InvalidInput(f"{name} has {len(values)} values but the model has {layers} layers; give one per layer "
                           "or a single number for all.", parameters=name)
    return values


def _check_layout_choice(activation: Any, shared_heads: Any, top_k: Any) -> None:
    """Either ``activation`` or both ``shared_heads`` and ``top_k``."""
    if (activation is None) == (shared_heads is None and top_k is None):
        raise InvalidInput("give either activation or both shared_heads and top_k.",
                           parameters=("activation", "shared_heads", "top_k"))
    if activation is None and (shared_heads is None or top_k is None):
        raise InvalidInput("shared_heads and top_k go together; give both.", parameters=("shared_heads", "top_k"))


def _calibration_folder(calibration: str | os.PathLike) -> Path:
    path = Path(calibration).expanduser()
    if not path.is_dir():
        raise InputNotFound(f"calibration {calibration}: no such folder (give an ImageFolder or a latent cache).",
                           parameters="calibration")
    return path


def _preset_value(preset: str, key: str) -> Any:
    """A preset's value of a constructor argument, the constructor's default where the preset has none."""
    if key in PRESETS[preset]:
        return PRESETS[preset][key]
    return inspect.signature(MoHDiTTransformer2DModel.__init__).parameters[key].default


def resolve_layout(dense: MoHDiTTransformer2DModel, activation: float | None = None,
                   shared_heads: int | Sequence[int] | None = None, top_k: int | Sequence[int] | None = None,
                   ) -> tuple[str | None, list[int], list[int]]:
    """``(preset, shared, top_k)`` per layer: for ``activation``, the layout of the upcycled
    preset that fits the dense architecture and has that activation (MoH-DiT-XL/2-up75, ...),
    else the upcycling rule's (:func:`~moh_dit.models.layout.upcycle_layout`, preset None;
    ValueError naming the reachable range outside it); or the given lists."""
    layers, heads = dense.config.num_layers, dense.layer_heads
    _check_layout_choice(activation, shared_heads, top_k)
    if activation is None:
        shared = _per_layer(shared_heads, layers, "shared_heads")
        k = _per_layer(top_k, layers, "top_k")
        HeadLayout.parse(layers, heads, shared, k)  # raises naming the bad layer
        return None, shared, k
    chosen = [name for name, (dense_name, act) in UPCYCLED_PRESETS.items()
              if math.isclose(act, float(activation))
              and all(_preset_value(dense_name, key) == dense.config[key] for key in _ARCH_KEYS)]
    if chosen:
        config = PRESETS[chosen[0]]
        return chosen[0], list(config["num_shared_heads"]), list(config["top_k"])
    shared, k = upcycle_layout(heads, float(activation))
    return None, shared, k


# --------------------------------------------------------------------------------------
# Calibration and head importance
# --------------------------------------------------------------------------------------


def _dataset(model: MoHDiTTransformer2DModel, path: Path, vae: Any, seed: int):
    """A latent cache, or an ImageFolder (pixels, or latents through ``vae``), matched to the model."""
    from ..data.datasets import ImageFolderDataset
    from ..data.latents import LatentDataset, load_vae, vae_downsample_factor

    size, channels = model.config.sample_size, model.config.in_channels
    if (path / "index.json").is_file():
        data = LatentDataset(path, random_flip=False, seed=seed)
        if tuple(data.latent_shape) != (channels, size, size):
            raise InvalidInput(f"calibration {path}: latents of shape {tuple(data.latent_shape)}, but the model "
                               f"takes {(channels, size, size)}.", parameters="calibration")
        return data, None
    if vae is None:
        if channels != 3:
            raise InvalidInput(f"calibration {path} is an image folder and the model takes {channels}-channel "
                               "latents: give vae to encode the images, or a latent cache.",
                               parameters=("calibration", "vae"))
        return ImageFolderDataset(path, size, random_flip=False, seed=seed), None
    vae = load_vae(vae) if isinstance(vae, (str, os.PathLike)) else vae
    return ImageFolderDataset(path, size * vae_downsample_factor(vae), random_flip=False, seed=seed), vae


def calibration_batches(model: MoHDiTTransformer2DModel, calibration: Any, num_batches: int = 4,
                        batch_size: int = 16, seed: int = 0, vae: Any = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_batches`` batches ``(x0, labels)`` of clean latents (or pixels) from ``calibration``:
    a folder (latent cache or ImageFolder), a dataset of ``(x0, label)`` items, or a list of
    ready batches. Items are drawn in a seeded random order, so all classes appear."""
    if isinstance(calibration, (list, tuple)) and calibration and isinstance(calibration[0], (list, tuple)):
        return [(x.float(), y.long()) for x, y in calibration][:num_batches]
    if isinstance(calibration, (str, os.PathLike)):
        data, vae = _dataset(model, _calibration_folder(calibration), vae, seed)
    else:
        data = calibration
    if len(data) == 0:
        raise ValueError("the calibration data is empty.")
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
    wanted = min(len(data), num_batches * batch_size)
    batches = []
    for start in range(0, wanted, batch_size):
        items = [data[i] for i in order[start:start + batch_size]]
        x = torch.stack([item[0] for item in items]).float()
        y = torch.tensor([int(item[1]) for item in items])
        if vae is not None:
            with torch.no_grad():
                shift = getattr(vae.config, "shift_factor", None) or 0.0
                x = (vae.encode(x).latent_dist.mean - shift) * vae.config.scaling_factor
        batches.append((x, y))
    size, channels = model.config.sample_size, model.config.in_channels
    if tuple(batches[0][0].shape[1:]) != (channels, size, size):
        raise ValueError(f"calibration inputs have shape {tuple(batches[0][0].shape[1:])}, the model takes "
                         f"{(channels, size, size)}.")
    top = max(int(y.max()) for _, y in batches)
    if top >= model.config.num_classes:
        raise ValueError(f"calibration label {top} is not a class of the model ({model.config.num_classes} classes).")
    return batches


def _noisy(batches, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each batch noised at uniformly drawn timesteps (seeded): ``(x_t, t, y)``."""
    diffusion = create_diffusion()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for x0, y in batches:
        t = torch.randint(0, diffusion.num_timesteps, (x0.shape[0],), generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        out.append((diffusion.q_sample(x0, t, noise), t, y))
    return out


@torch.no_grad()
def head_importance(dense: MoHDiTTransformer2DModel, batches, seed: int = 0, progress: bool = True) -> list[list[float]]:
    """Per layer and head: how much the model's eps prediction changes when that head alone is
    removed, ``sum ||eps - eps_without||^2 / sum ||eps||^2`` over the calibration batches
    (noised at seeded uniform timesteps). A head is removed exactly by zeroing its columns of
    the output projection (``out = sum_i H_i W_O^i + b``)."""
    from tqdm.auto import tqdm

    dense = dense.eval()
    device = next(dense.parameters()).device
    inputs = [tuple(v.to(device) for v in item) for item in _noisy(batches, seed)]
    channels = dense.config.in_channels
    base = [dense(x, t, y).sample[:, :channels] for x, t, y in inputs]
    energy = sum(float(b.double().pow(2).sum()) for b in base) or 1.0
    d = dense.config.attention_head_dim
    result: list[list[float]] = []
    bar = tqdm(total=sum(dense.layer_heads), desc="head importance", disable=not progress)
    for block in dense.transformer_blocks:
        weight = block.attn1.to_out[0].weight
        scores = []
        for head in range(block.attn1.heads):
            cols = slice(head * d, (head + 1) * d)
            kept = weight[:, cols].clone()
            weight[:, cols] = 0
            try:
                change = sum(float((dense(x, t, y).sample[:, :channels] - b).double().pow(2).sum())
                             for (x, t, y), b in zip(inputs, base))
            finally:
                weight[:, cols] = kept
            scores.append(change / energy)
            bar.update(1)
        result.append(scores)
    bar.close()
    return result


def choose_heads(heads: Sequence[int], shared: Sequence[int], top_k: Sequence[int],
                 importance: list[list[float]] | None) -> list[LayerChoice]:
    """Per layer the ``hs`` most important heads are shared (ties: lower head number first) and
    the rest routed, most important first. Without measurements the stated default is the
    release's convention: heads ``0 .. hs-1`` shared, the rest routed in order."""
    choices = []
    for layer, (h, hs, k) in enumerate(zip(heads, shared, top_k)):
        if importance is None:
            ranked = list(range(h))
        else:
            ranked = sorted(range(h), key=lambda i: (-importance[layer][i], i))
        choices.append(LayerChoice(layer, h, ranked[:hs], ranked[hs:], k,
                                   None if importance is None else list(importance[layer])))
    return choices


# --------------------------------------------------------------------------------------
# Weights and the first-forward check
# --------------------------------------------------------------------------------------


def _head_rows(order: Sequence[int], d: int) -> torch.Tensor:
    return torch.cat([torch.arange(i * d, (i + 1) * d) for i in order])


def transfer_weights(dense: MoHDiTTransformer2DModel, moh: MoHDiTTransformer2DModel, choices: list[LayerChoice]) -> None:
    """Every dense weight into ``moh`` with each layer's heads reordered (QKV rows and output
    columns per head, which leaves the function unchanged); every router weight zero."""
    source = dense.state_dict()
    target = {key: torch.zeros_like(value) for key, value in moh.state_dict().items() if ".router_" in key}
    d = dense.config.attention_head_dim
    for key, value in source.items():
        target[key] = value.clone()
    for c in choices:
        rows = _head_rows(c.order, d)
        prefix = f"transformer_blocks.{c.layer}.attn1"
        for p in "qkv":
            for suffix in ("weight", "bias"):
                target[f"{prefix}.to_{p}.{suffix}"] = source[f"{prefix}.to_{p}.{suffix}"][rows].clone()
        target[f"{prefix}.to_out.0.weight"] = source[f"{prefix}.to_out.0.weight"][:, rows].clone()
    moh.load_state_dict(target, strict=True)


class _HeadMaskProcessor:
    """Dense attention with each head's output multiplied by a fixed (B, N, h) mask."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def __call__(self, attn, hidden_states):
        return MoHAttnProcessor()(attn, hidden_states, MoHRouting(self.mask))


@torch.no_grad()
def dense_forward_with_head_mask(dense: MoHDiTTransformer2DModel, x, t, y, masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """The dense model's output with head ``i`` of layer ``l`` removed wherever
    ``masks[l][b, n, i] == 0`` (dense head numbers; kept heads weigh exactly 1)."""
    old = [block.attn1.processor for block in dense.transformer_blocks]
    try:
        for block, mask in zip(dense.transformer_blocks, masks):
            block.attn1.set_processor(_HeadMaskProcessor((mask != 0).float()))
        return dense(x, t, y).sample
    finally:
        for block, processor in zip(dense.transformer_blocks, old):
            block.attn1.set_processor(processor)


@torch.no_grad()
def routing_head_masks(moh: MoHDiTTransformer2DModel, x, t, y, choices: list[LayerChoice]):
    """``(sample, gates)``: the MoH model's output and, per layer, its gates (B, N, h) put back in
    dense head order (zero where a token did not select a routed head)."""
    found: list[torch.Tensor] = []
    hooks = [block.attn1.register_forward_hook(lambda attn, _i, _out: found.append(attn.routing.gates))
             for block in moh.transformer_blocks]
    try:
        sample = moh(x, t, y).sample
    finally:
        for hook in hooks:
            hook.remove()
    gates = []
    for c, g in zip(choices, found):
        dense_order = torch.zeros_like(g)
        dense_order[..., c.order] = g
        gates.append(dense_order)
    return sample, gates


def first_forward_gap(dense, moh, choices: list[LayerChoice], x, t, y) -> tuple[float, list[torch.Tensor]]:
    """Largest |MoH output - dense output with the heads the MoH routers left out removed|,
    and the MoH gates per layer in dense head order."""
    sample, gates = routing_head_masks(moh.eval(), x, t, y, choices)
    reference = dense_forward_with_head_mask(dense.eval(), x, t, y, gates)
    return float((sample - reference).abs().max()), gates


# --------------------------------------------------------------------------------------
# The whole step
# --------------------------------------------------------------------------------------


def _check_input(dense: MoHDiTTransformer2DModel, batches, seed: int, device) -> tuple[torch.Tensor, ...]:
    """The first-forward check's input: a calibration batch noised afresh, or without data two
    noise images (t = 999 and 250; a class and the null class)."""
    if batches:
        x, t, y = _noisy(batches[:1], seed + 1)[0]
    else:
        gen = torch.Generator().manual_seed(seed)
        size = dense.config.sample_size
        x = torch.randn(2, dense.config.in_channels, size, size, generator=gen)
        t, y = torch.tensor([999, 250]), torch.tensor([0, dense.config.num_classes])
    return x.to(device), t.to(device), y.to(device)


def _precheck(activation, shared_heads, top_k, calibration, heads: list[int] | None) -> None:
    """The checks that need no weights, before a (slow) checkpoint load; ``heads``: the dense
    model's heads per layer where they are known without loading it."""
    _check_layout_choice(activation, shared_heads, top_k)
    if activation is not None:
        if isinstance(activation, bool) or not isinstance(activation, (int, float)) or not 0 < activation <= 1:
            raise InvalidInput(f"activation must be in (0, 1] (1.0: every head active), got {activation!r}.",
                               parameters="activation")
        if heads is not None:
            upcycle_layout(heads, float(activation))  # refuses a ratio outside the model's reachable range
    if isinstance(calibration, (str, os.PathLike)):
        _calibration_folder(calibration)


def upcycle(dense_model_or_source: Any, activation: float | None = None, *, shared_heads=None, top_k=None,
            calibration: Any = None, calibration_batches_count: int = 4, batch_size: int = 16, preset: str | None = None,
            weights: str = "ema", sample_size: int | None = None, num_classes: int | None = None, vae: Any = None,
            seed: int = 0, progress: bool = True, device: str | torch.device = "cpu",
            ) -> tuple[MoHDiTTransformer2DModel, UpcycleReport]:
    """A MoH-DiT from a dense DiT, and the report of what each layer became.

    ``activation`` (any head activation in the model's reachable range, ``[layers / heads, 1]``)
    takes the upcycled preset's layout where one fits the model at that activation
    (MoH-DiT-XL/2-up75, ...), else the upcycling rule's (:func:`resolve_layout`); or
    ``shared_heads`` and ``top_k`` (an int or one per layer). ``calibration`` (a folder, a
    dataset or a list of ``(x0, labels)`` batches) measures head importance on
    ``calibration_batches_count`` batches of ``batch_size``; without it heads 0..hs-1 are
    shared. ``preset`` names the dense preset of a checkpoint that is not a saved model folder.
    The measurements run on ``device`` (the dense model is moved there; the MoH model is
    returned there).
    """
    for name, value in (("calibration_batches_count", calibration_batches_count), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInput(f"{name} must be an int >= 1, got {value!r}.", parameters=name)
    _precheck(activation, shared_heads, top_k, calibration, _source_heads(dense_model_or_source, preset))
    dense, name = load_dense(dense_model_or_source, preset, weights, sample_size, num_classes)
    dense = dense.to(device)
    preset_name, shared, k = resolve_layout(dense, activation, shared_heads, top_k)
    batches = None
    if calibration is not None:
        batches = calibration_batches(dense, calibration, calibration_batches_count, batch_size, seed, vae)
    importance = head_importance(dense, batches, seed, progress) if batches else None
    choices = choose_heads(dense.layer_heads, shared, k, importance)
    config = {key: value for key, value in dict(dense.config).items() if not key.startswith("_")}
    config.update(num_attention_heads=list(dense.layer_heads), num_shared_heads=shared, top_k=k)
    moh = MoHDiTTransformer2DModel(**config)
    transfer_weights(dense, moh, choices)
    moh = moh.to(device).eval()
    gap, gates = first_forward_gap(dense, moh, choices, *_check_input(dense, batches, seed, device))
    for c, g in zip(choices, gates):
        used = (g != 0).flatten(0, -2).any(dim=0)
        c.first_selected = [i for i in c.routed if bool(used[i])]
    images = sum(int(b[0].shape[0]) for b in batches) if batches else 0
    how = (f"importance measured on {images} calibration inputs" if batches
           else "the default without calibration data (heads 0..hs-1 shared, as the MoH release)")
    report = UpcycleReport(name, preset_name, moh.trained_head_activation_ratio, how, images, choices, gap,
                           requested_activation=None if activation is None else float(activation))
    return moh, report


def is_upcycled_folder(path: Path) -> bool:
    """Whether ``path`` is what :func:`save_upcycled` wrote before it marked its outputs: a saved
    model with ``upcycle_report.json`` and nothing else."""
    return is_model_folder(path, extra=(REPORT_FILE,))


def check_output(output_dir: str | os.PathLike, overwrite: bool = False) -> None:
    """Refuse an output folder that is a file or lies under one, and an existing folder unless
    ``overwrite`` and it is empty or an earlier upcycled model (marked by moh-dit upcycle, or
    :func:`is_upcycled_folder`): nothing else is ever replaced. Run before any work."""
    output_dir = Path(output_dir)
    check_folder_path(output_dir, "output_dir", "give a folder path", error=FileExistsError)
    check_replaceable(output_dir, overwrite, "upcycle", is_upcycled_folder,
                      f"an upcycled model (a saved MoHDiTTransformer2DModel with {REPORT_FILE})", "output_dir")


def save_upcycled(model: MoHDiTTransformer2DModel, report: UpcycleReport, output_dir: str | os.PathLike,
                  overwrite: bool = False) -> Path:
    """The model (``save_pretrained``) and ``upcycle_report.json``, published together by one
    atomic rename into ``output_dir``, which must not exist or be an empty folder, or, with
    ``overwrite``, an earlier upcycled model (:func:`check_output`). A failed write (disk
    full, ...) is an OSError naming ``output_dir``."""
    output_dir = Path(output_dir)
    check_output(output_dir, overwrite)
    with naming_write_errors(output_dir), publish_folder(output_dir, replace=True) as tmp:  # refused above if not ours
        model.save_pretrained(tmp, safe_serialization=True)
        write_json_atomic(tmp / REPORT_FILE, report.to_json())
        write_output_marker(tmp, "upcycle")
    return output_dir
