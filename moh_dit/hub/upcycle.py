"""Upcycling: a dense DiT becomes a MoH-DiT that keeps every dense weight.

Every layer keeps its heads; the layout is an upcycled preset's where one fits, else :func:`upcycle_layout`'s.
Per layer the ``hs`` most important heads (the change of the eps prediction when the head alone is removed,
on calibration data) become the shared heads, the others the routed ones; heads are reordered inside the QKV
and output projections (shared first), which leaves the dense function unchanged. All routers start at zero:
equal scores make every release gate exactly 1 (``hs * softmax(0)``, ``K * p / sum_topK p``, ``2 * softmax(0)``),
so the first forward is the dense model with each token's unselected heads removed (:func:`first_forward_gap`).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Sequence

import torch

from ..models import PRESETS, HeadLayout, MoHDiTTransformer2DModel
from ..outputs import output_folder, write_json
from .convert import convert_checkpoint

__all__ = ["REPORT_FILE", "LayerChoice", "UpcycleReport", "upcycle_layout", "resolve_layout", "load_dense",
           "calibration_batches", "head_importance", "choose_heads", "transfer_weights", "first_forward_gap",
           "upcycle", "save_upcycled"]

REPORT_FILE = "upcycle_report.json"
_ARCHITECTURE = ("num_layers", "hidden_size", "attention_head_dim", "patch_size", "in_channels", "learn_sigma")


@dataclass
class LayerChoice:
    """What one layer became, in the dense model's head numbers; ``order`` is the dense head at each
    position of the upcycled layer (shared first, then routed)."""

    layer: int
    heads: int
    shared: list[int]
    routed: list[int]
    top_k: int
    importance: list[float] | None  # per dense head; None when not measured

    @property
    def order(self) -> list[int]:
        return self.shared + self.routed


@dataclass
class UpcycleReport:
    """Per-layer choices and how they were made, saved beside the model as ``upcycle_report.json``."""

    source: str
    preset: str | None  # the upcycled preset whose layout this is, if any
    activation: float  # realised: sum (hs + K) / sum h
    requested_activation: float | None  # None for a layout given per layer
    calibration: str
    layers: list[LayerChoice]
    first_forward_max_abs_diff: float | None = None

    def table(self) -> str:
        """One line per layer: heads, shared / routed (dense head numbers), top-K, importance."""
        asked = self.requested_activation
        layout = self.preset or ("a given layout" if asked is None else "the upcycling rule's layout")
        active, total = sum(len(c.shared) + c.top_k for c in self.layers), sum(c.heads for c in self.layers)
        asked = "" if asked is None else f"requested {asked:g}, "
        lines = [f"upcycled {self.source} -> {layout} (head activation {asked}realised {active}/{total} = "
                 f"{self.activation:.4f}); shared heads chosen by {self.calibration}"]
        for c in self.layers:
            imp = " ".join(f"{i}:{v:.3g}" for i, v in enumerate(c.importance)) if c.importance else "not measured"
            lines.append(f"layer {c.layer:2d}: {c.heads} heads, shared {c.shared}, routed {c.routed}, "
                         f"top-K {c.top_k}; importance {imp}")
        lines.append(f"first forward vs dense with unselected heads removed: max |diff| "
                     f"{self.first_forward_max_abs_diff:.3g}")
        return "\n".join(lines)


# ----- the layout -----------------------------------------------------------------------------

def upcycle_layout(heads: Sequence[int], ratio: float) -> tuple[list[int], list[int]]:
    """Per-layer ``(shared, top_k)`` of a dense model with ``heads`` per layer at the head activation
    nearest ``ratio``: ``A = round(ratio * sum h)`` active heads (ties up; ``ratio`` read as the decimal
    it prints as), anything from one head per layer to every head.

    The first third of the layers keep every head, as in the paper's XL and L layouts; the inactive
    heads are spread over the later layers (more layers when needed so that none leaves more than
    half its heads inactive; all of them beyond half when even that is not enough), one at a time
    from the last layer backwards, so that the later layers take the extra ones. A layer leaving
    ``d > 0`` heads inactive routes ``K = min(ceil(d / 2), h - d)`` of ``d + K`` heads (the router
    always has a choice) and shares the rest.
    """
    layers, total = len(heads), sum(heads)
    if not layers / total - 1e-9 <= ratio <= 1.0 + 1e-9:  # also refuses nan
        raise ValueError(f"activation {ratio} is outside the reachable range [{layers / total:.4f}, 1.0] of this "
                         f"dense model ({layers} layers, {total} heads: one active head per layer at least)")
    active = min(max(math.floor(Fraction(repr(float(ratio))) * total + Fraction(1, 2)), layers), total)
    drop, half = total - active, [h // 2 for h in heads]
    fits = [n for n in range(layers - layers // 3, layers + 1) if sum(half[layers - n:]) >= drop]
    routed, limit = (fits[0], half) if fits else (layers, [h - 1 for h in heads])
    order = [i for i in range(layers - 1, layers - routed - 1, -1) if limit[i] > 0]
    drops = [0] * layers
    while drop:
        for i in order:
            if drop and drops[i] < limit[i]:
                drops[i] += 1
                drop -= 1
    top_k = [min((d + 1) // 2, h - d) if d else 0 for h, d in zip(heads, drops)]
    return [h - d - k for h, d, k in zip(heads, drops, top_k)], top_k


def resolve_layout(dense: MoHDiTTransformer2DModel, activation: float | None = None,
                   shared_heads: int | Sequence[int] | None = None, top_k: int | Sequence[int] | None = None,
                   ) -> tuple[str | None, list[int], list[int]]:
    """``(preset, shared, top_k)`` per layer: for ``activation`` the layout of an upcycled preset
    (``*-up75``, ...) that fits the dense architecture at that activation, else the rule's
    (preset None); or the given ``shared_heads`` and ``top_k`` (an int or one per layer)."""
    config = dense.config
    heads = list(HeadLayout.of_config(config).heads)
    if (activation is None) == (shared_heads is None or top_k is None) or (shared_heads is None) != (top_k is None):
        raise ValueError("give activation (--activation), or shared_heads and top_k (--shared-heads, --top-k)")
    if activation is None:
        layout = HeadLayout.parse(len(heads), heads, shared_heads, top_k)
        return None, list(layout.shared), list(layout.top_k)
    for name, preset in PRESETS.items():  # an upcycled preset is named for its activation: MoH-DiT-XL/2-up75
        nominal = name.rpartition("-up")[2]
        if nominal.isdigit() and math.isclose(int(nominal) / 100, activation) and all(
                preset.get(key, config[key]) == config[key] for key in _ARCHITECTURE):
            layout = HeadLayout.of_config(preset)
            if list(layout.heads) == heads:
                return name, list(layout.shared), list(layout.top_k)
    return None, *upcycle_layout(heads, activation)


# ----- the dense model and calibration --------------------------------------------------------

def load_dense(source: Any, preset: str | None = None, weights: str = "ema", sample_size: int | None = None,
               num_classes: int | None = None) -> tuple[MoHDiTTransformer2DModel, str]:
    """The dense model and a name for it: a dense model, a model folder (``save_pretrained``), a
    pipeline folder holding one as ``transformer/`` (a training run's ``final/``), or anything
    :func:`~moh_dit.hub.convert.convert_checkpoint` reads for the dense ``preset``."""
    if isinstance(source, MoHDiTTransformer2DModel):
        model = source
    else:
        path = Path(source).expanduser()
        folder = path / "transformer" if (path / "model_index.json").is_file() else path
        config = MoHDiTTransformer2DModel.load_config(folder) if (folder / "config.json").is_file() else {}
        if config.get("_class_name") == "MoHDiTTransformer2DModel":  # load_config's errors name the file
            model = MoHDiTTransformer2DModel.from_pretrained(folder)
        elif preset is None:
            raise ValueError(f"{source} needs preset (--preset), the dense DiT it holds (e.g. DiT-XL/2); only a "
                             "model folder names its own architecture")
        elif PRESETS[preset].get("num_shared_heads") is not None:
            raise ValueError(f"preset {preset} is a MoH model; give the dense DiT preset of the checkpoint")
        else:
            model = convert_checkpoint(source, preset, weights=weights, sample_size=sample_size,
                                       num_classes=num_classes)
    if model.is_moh:
        raise ValueError(f"{source} is already a MoH model (it has routers); upcycling starts from a dense DiT")
    return model.eval(), "the given model" if source is model else str(source)


def _folder_dataset(model: MoHDiTTransformer2DModel, path: Path, vae: Any):
    """A latent cache (``index.json``) or an image folder, at the model's input size."""
    if (path / "index.json").is_file():
        from ..data.latents import LatentDataset

        return LatentDataset(path, random_flip=False), None
    from torchvision import datasets, transforms

    if vae is not None and not isinstance(vae, torch.nn.Module):
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(vae)
    size = model.config.sample_size * (2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else 1)
    pixels = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor(),
                                 transforms.Normalize(0.5, 0.5)])
    return datasets.ImageFolder(str(path), pixels), vae


def calibration_batches(model: MoHDiTTransformer2DModel, calibration: Any, num_batches: int = 4, batch_size: int = 16,
                        seed: int = 0, vae: Any = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to ``num_batches`` batches ``(x0, labels)`` of clean model inputs from ``calibration``: a
    folder (a latent cache, or an image folder, encoded by ``vae`` for a latent model), a dataset of
    ``(x0, label)`` items, or a list of ready batches. Items are drawn in a seeded random order."""
    if isinstance(calibration, list):
        return [(x.float(), y.long()) for x, y in calibration[:num_batches]]
    data = calibration
    if isinstance(calibration, (str, os.PathLike)):
        if not Path(calibration).is_dir():
            raise FileNotFoundError(2, "no such calibration folder (an image folder or a latent cache)",
                                    str(calibration))
        data, vae = _folder_dataset(model, Path(calibration), vae)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
    batches = []
    for start in range(0, min(len(data), num_batches * batch_size), batch_size):
        items = [data[i] for i in order[start:start + batch_size]]
        x, y = torch.stack([item[0] for item in items]).float(), torch.tensor([int(item[1]) for item in items])
        if vae is not None:
            with torch.no_grad():
                shift = getattr(vae.config, "shift_factor", None) or 0.0
                x = (vae.encode(x).latent_dist.mean - shift) * vae.config.scaling_factor
        batches.append((x, y))
    return batches


def _noisy(batches, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each batch noised at uniformly drawn timesteps (seeded): ``(x_t, t, y)``."""
    from ..diffusion import create_diffusion

    diffusion, gen = create_diffusion(), torch.Generator().manual_seed(seed)
    out = []
    for x0, y in batches:
        t = torch.randint(0, diffusion.num_timesteps, (x0.shape[0],), generator=gen)
        out.append((diffusion.q_sample(x0, t, torch.randn(x0.shape, generator=gen)), t, y))
    return out


@torch.no_grad()
def head_importance(dense: MoHDiTTransformer2DModel, batches, seed: int = 0, progress: bool = True
                    ) -> list[list[float]]:
    """Per layer and head, ``sum ||eps - eps_without||^2 / sum ||eps||^2`` over the calibration
    batches noised at seeded uniform timesteps, where ``eps_without`` is the prediction with that head
    alone removed: its columns of the output projection zeroed (``out = sum_i H_i W_O^i + b``)."""
    from tqdm.auto import tqdm

    device, channels = next(dense.parameters()).device, dense.config.in_channels
    inputs = [tuple(v.to(device) for v in item) for item in _noisy(batches, seed)]
    base = [dense(x, t, y).sample[:, :channels] for x, t, y in inputs]
    energy = sum(float(b.double().pow(2).sum()) for b in base) or 1.0
    d = dense.config.attention_head_dim
    result = []
    bar = tqdm(total=sum(HeadLayout.of_config(dense.config).heads), desc="head importance", disable=not progress)
    for block in dense.transformer_blocks:
        weight, scores = block.attn1.to_out[0].weight, []
        for head in range(weight.shape[1] // d):
            kept = weight[:, head * d:(head + 1) * d].clone()
            weight[:, head * d:(head + 1) * d] = 0
            change = sum(float((dense(x, t, y).sample[:, :channels] - b).double().pow(2).sum())
                         for (x, t, y), b in zip(inputs, base))
            weight[:, head * d:(head + 1) * d] = kept
            scores.append(change / energy)
            bar.update()
        result.append(scores)
    bar.close()
    return result


def choose_heads(heads: Sequence[int], shared: Sequence[int], top_k: Sequence[int],
                 importance: list[list[float]] | None) -> list[LayerChoice]:
    """Per layer the ``hs`` most important heads are shared (ties: the lower head number) and the rest
    routed, most important first; without measurements heads ``0 .. hs-1`` are shared, as in the release."""
    choices = []
    for layer, (h, hs, k) in enumerate(zip(heads, shared, top_k)):
        ranked = sorted(range(h), key=lambda i: (-importance[layer][i], i)) if importance else list(range(h))
        choices.append(LayerChoice(layer, h, ranked[:hs], ranked[hs:], k, importance[layer] if importance else None))
    return choices


# ----- the weights and the first forward -------------------------------------------------------

def transfer_weights(dense: MoHDiTTransformer2DModel, moh: MoHDiTTransformer2DModel, choices: list[LayerChoice]
                     ) -> None:
    """Every dense weight into ``moh`` with each layer's heads reordered (QKV rows and output-projection
    columns per head, which leaves the function unchanged); every router weight zero."""
    source, d = dense.state_dict(), dense.config.attention_head_dim
    target = {key: torch.zeros_like(value) for key, value in moh.state_dict().items() if "router" in key}
    target.update({key: value.clone() for key, value in source.items()})
    for c in choices:
        rows = torch.cat([torch.arange(i * d, (i + 1) * d) for i in c.order])
        prefix = f"transformer_blocks.{c.layer}.attn1"
        for key in (f"{prefix}.to_{p}.{s}" for p in "qkv" for s in ("weight", "bias")):
            target[key] = source[key][rows].clone()
        target[f"{prefix}.to_out.0.weight"] = source[f"{prefix}.to_out.0.weight"][:, rows].clone()
    moh.load_state_dict(target, strict=True)


@torch.no_grad()
def _run_with_heads(model: MoHDiTTransformer2DModel, x, t, y, masks: Sequence[torch.Tensor] | None = None):
    """``(sample, heads)``: the output, and per layer which heads reached the output projection
    (B, N, h); with ``masks`` (B, N, h), each layer's heads are first multiplied by its mask."""
    d, found, hooks = model.config.attention_head_dim, [], []
    for i, block in enumerate(model.transformer_blocks):
        to_out = block.attn1.to_out[0]
        if masks is not None:
            hooks.append(to_out.register_forward_pre_hook(
                lambda _m, args, mask=masks[i]: (args[0] * mask.repeat_interleave(d, -1).to(args[0].dtype),)))
        # a forward hook sees the input after every pre-hook, MoH's gates included
        hooks.append(to_out.register_forward_hook(lambda _m, args, _out: found.append(
            args[0].unflatten(-1, (-1, d)).ne(0).any(-1))))
    try:
        return model(x, t, y).sample, found
    finally:
        for hook in hooks:
            hook.remove()


def first_forward_gap(dense: MoHDiTTransformer2DModel, moh: MoHDiTTransformer2DModel, choices: list[LayerChoice],
                      x, t, y) -> tuple[float, list[torch.Tensor]]:
    """Largest |MoH output - dense output with the heads the MoH routers left out removed|, and per
    layer the heads each token used (B, N, h), in dense head order."""
    sample, used = _run_with_heads(moh.eval(), x, t, y)
    masks = [torch.zeros_like(u, dtype=torch.float32).index_copy_(-1, torch.tensor(c.order, device=u.device), u.float())
             for c, u in zip(choices, used)]  # mask[..., order[j]] = used[..., j]
    reference, _ = _run_with_heads(dense.eval(), x, t, y, masks)
    return float((sample - reference).abs().max()), masks


# ----- the whole step ---------------------------------------------------------------------------

def upcycle(source: Any, activation: float | None = None, *, shared_heads=None, top_k=None, calibration: Any = None,
            calibration_batches_count: int = 4, batch_size: int = 16, preset: str | None = None, weights: str = "ema",
            sample_size: int | None = None, num_classes: int | None = None, vae: Any = None, seed: int = 0,
            device: str | torch.device = "cpu", progress: bool = True, output_dir: str | os.PathLike | None = None,
            overwrite: bool = False) -> tuple[MoHDiTTransformer2DModel, UpcycleReport]:
    """A MoH-DiT from a dense DiT (:func:`load_dense` reads ``source``) and the report of each layer. The
    layout: ``activation`` (:func:`resolve_layout`), or ``shared_heads`` and ``top_k``. ``calibration`` (a
    folder, a dataset or ``(x0, labels)`` batches) measures head importance on ``device``; without it heads
    0..hs-1 are shared. ``output_dir``: written as :func:`save_upcycled` does, checked before any work."""
    inputs = {name: p for name, p in (("checkpoint", source), ("calibration", calibration), ("vae", vae))
              if isinstance(p, (str, os.PathLike)) and Path(p).expanduser().exists()}
    with contextlib.nullcontext() if output_dir is None else output_folder(
            output_dir, "upcycle", overwrite=overwrite, inputs=inputs, publish=True) as folder:
        dense, name = load_dense(source, preset, weights, sample_size, num_classes)
        dense = dense.to(device)
        preset_name, shared, k = resolve_layout(dense, activation, shared_heads, top_k)
        batches = None
        if calibration is not None:
            batches = calibration_batches(dense, calibration, calibration_batches_count, batch_size, seed, vae)
        importance = head_importance(dense, batches, seed, progress) if batches else None
        heads = list(HeadLayout.of_config(dense.config).heads)
        choices = choose_heads(heads, shared, k, importance)
        config = {key: value for key, value in dense.config.items() if not key.startswith("_")}
        moh = MoHDiTTransformer2DModel(**{**config, "num_attention_heads": heads, "num_shared_heads": shared,
                                          "top_k": k})
        transfer_weights(dense, moh, choices)
        moh = moh.to(device).eval()
        if batches:  # a calibration batch noised afresh; else noise at t = 999 and 250, a class and the null class
            x, t, y = _noisy(batches[:1], seed + 1)[0]
        else:
            size = dense.config.sample_size
            x = torch.randn(2, dense.config.in_channels, size, size, generator=torch.Generator().manual_seed(seed))
            t, y = torch.tensor([999, 250]), torch.tensor([0, dense.config.num_classes])
        gap, _ = first_forward_gap(dense, moh, choices, x.to(device), t.to(device), y.to(device))
        images = sum(len(b[1]) for b in batches) if batches else 0
        how = (f"importance measured on {images} calibration inputs" if batches
               else "the release's default without calibration data (heads 0..hs-1)")
        report = UpcycleReport(name, preset_name, HeadLayout.parse(len(heads), heads, shared, k).activation_ratio(),
                               None if activation is None else float(activation), how, choices, gap)
        if folder is not None:
            _save(moh, report, folder)
    return moh, report


def _save(model: MoHDiTTransformer2DModel, report: UpcycleReport, folder: Path) -> None:
    model.save_pretrained(folder)
    write_json(folder / REPORT_FILE, {**asdict(report), "layers": [{**asdict(c), "order": c.order}
                                                                  for c in report.layers]})


def save_upcycled(model: MoHDiTTransformer2DModel, report: UpcycleReport, output_dir: str | os.PathLike,
                  overwrite: bool = False) -> Path:
    """The model and ``upcycle_report.json`` published into ``output_dir`` (``overwrite``: only upcycle's own)."""
    with output_folder(output_dir, "upcycle", overwrite=overwrite, publish=True) as tmp:
        _save(model, report, tmp)
    return Path(output_dir)
