"""``MoHDiTPipeline``: class-conditional sampling from a MoH-DiT (or dense DiT) transformer.

diffusers' ``DiTPipeline`` (the same positional arguments, ``randn_tensor``, ``progress_bar``,
CPU offload, step callbacks, LoRA loading) plus what MoH-DiT needs: the null class from the
model's config; the head activation ratio per call, also per denoising step; DiT's guidance on
the first three eps channels; one seed per image for every noise draw, so that image ``i`` does
not depend on its batch; the learned-range variance for DDPM and the eps half for any other
scheduler swapped in with ``from_config``; pixel-space models without a VAE. This file imports
only torch, diffusers, numpy and PIL, so that an exported pipeline folder carries it as it is.
"""

from __future__ import annotations

import copy
import errno
import inspect
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import PIL.Image
import torch
from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
# diffusers.loaders exports the pipeline LoRA mixins only when transformers is installed; the
# module itself needs neither transformers nor peft.
from diffusers.loaders.lora_pipeline import SanaLoraLoaderMixin
from diffusers.models import AutoencoderKL
from diffusers.models.modeling_utils import ModelMixin
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor

__all__ = ["MoHDiTPipeline", "MoHDiTPipelineOutput", "make_scheduler"]


def make_scheduler(kind: str = "ddpm", clip_sample: bool = False) -> SchedulerMixin:
    """The paper's diffusion (1000 linear betas 1e-4..0.02) as a diffusers scheduler.

    ``"ddpm"``: ancestral sampling with the learned-range variance, DiT's ``p_sample_loop``;
    linspace spacing keeps ``round(linspace(0, 999, n))``, ADM's ``space_timesteps`` for round
    counts (pass ``timesteps=`` to the pipeline for any other list). ``"ddim"``: DiT's
    ``ddim_sample_loop`` on the strided timesteps ``0, s, ..., (n-1)s``, ``s = 1000 // n`` (diffusers'
    DDIM steps from t to t - s, so only leading spacing matches the alphas). ``"dpm"``:
    DPM-Solver++(2M). ``clip_sample`` clamps x0 to [-1, 1] (IDDPM's ``clip_denoised``), for
    pixel-space models: DiT's latents are not bounded.
    """
    common = dict(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02,
                  prediction_type="epsilon")
    if kind == "ddpm":
        return DDPMScheduler(**common, variance_type="learned_range", clip_sample=clip_sample,
                             timestep_spacing="linspace")
    if kind == "ddim":
        return DDIMScheduler(**common, clip_sample=clip_sample, set_alpha_to_one=True, steps_offset=0,
                             timestep_spacing="leading")
    if kind == "dpm":  # DPM-Solver has no x0 clipping (clip_sample is ignored)
        return DPMSolverMultistepScheduler(**common, algorithm_type="dpmsolver++", solver_order=2,
                                           timestep_spacing="linspace")
    raise ValueError(f"unknown scheduler kind {kind!r}; choose ddpm, ddim or dpm.")


def _flatten(labels: Any) -> Iterator[Any]:
    """The items of nested lists, tuples, tensors and arrays in order, as DiTPipeline flattens them."""
    if torch.is_tensor(labels) or isinstance(labels, np.ndarray):
        yield from labels.reshape(-1).tolist()
    elif isinstance(labels, (list, tuple)):
        for item in labels:
            yield from _flatten(item)
    else:
        yield labels


@dataclass
class MoHDiTPipelineOutput(BaseOutput):
    """``images``: PIL images, a (B, H, W, C) array in [0, 1] (``"np"``), a (B, C, H, W) tensor in
    [0, 1] (``"pt"``) or the final latents (``"latent"``). ``head_activation_ratio``: the mean of
    ``head_activation_ratios``, the realised ratio of every step that ran. ``head_usage``: per layer
    (h_l,), the fraction of tokens that used each head over all transformer calls (guided runs
    include the unconditional half); None with ``output_head_usage=False``."""

    images: list[PIL.Image.Image] | np.ndarray | torch.Tensor
    head_activation_ratio: float
    head_usage: list[torch.Tensor] | None
    head_activation_ratios: list[float]


class MoHDiTPipeline(DiffusionPipeline, SanaLoraLoaderMixin):
    r"""Class-conditional image generation with a ``MoHDiTTransformer2DModel``.

    Args:
        transformer: the MoH-DiT (or dense DiT) model; it predicts eps (and, with learned sigma,
            the variance values) for latents, or for images in [-1, 1] without a VAE.
        scheduler: a diffusers scheduler, e.g. :func:`make_scheduler` (the paper's DDPM).
        vae: an ``AutoencoderKL`` for latent models; None for pixel-space models.
        id2label: class id -> name (saved with the pipeline); default the model's ``class_names``.

    Examples:

    ```py
    >>> from diffusers import AutoencoderKL, DPMSolverMultistepScheduler
    >>> from moh_dit import MoHDiTPipeline, MoHDiTTransformer2DModel
    >>> from moh_dit.diffusion import make_scheduler

    >>> transformer = MoHDiTTransformer2DModel.from_pretrained("moh-dit-xl-2-90")  # moh-dit convert's output
    >>> vae = AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-ema")
    >>> pipe = MoHDiTPipeline(transformer=transformer, vae=vae, scheduler=make_scheduler("ddpm")).to("cuda")
    >>> out = pipe([207, 0, 88], guidance_scale=1.5, num_inference_steps=250, head_activation_ratio=0.8,
    ...            seeds=[0, 1, 2])
    >>> out.images[0].save("golden_retriever.png")
    >>> out = pipe([0], head_activation_ratio="linear:0.5:1.0", seeds=[0])  # a ratio per step
    >>> pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    >>> images = pipe([0], num_inference_steps=25, seeds=[0]).images
    ```
    """

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["vae"]
    _callback_tensor_inputs = ["latents"]

    def __init__(self, transformer: ModelMixin, scheduler: SchedulerMixin, vae: AutoencoderKL | None = None,
                 id2label: dict[str, str] | None = None):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)
        if id2label is None and transformer.config.get("class_names"):
            id2label = dict(enumerate(transformer.config.class_names))
        # JSON keys are strings: stored that way, a reloaded config equals the saved one
        self.register_to_config(id2label=None if id2label is None else {str(k): v for k, v in id2label.items()})

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs: Any) -> "MoHDiTPipeline":
        """``DiffusionPipeline.from_pretrained``; a training run's folder is refused naming the
        pipeline it holds, ``run/final``."""
        folder = Path(str(pretrained_model_name_or_path))
        if not (folder / "model_index.json").exists() and (folder / "final" / "model_index.json").is_file():
            raise FileNotFoundError(errno.ENOENT, f"{folder} is a training run, not a pipeline: load its pipeline "
                                    f"from {folder / 'final'}", str(folder / "model_index.json"))
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_pipe(cls, pipeline: DiffusionPipeline, **kwargs: Any) -> "MoHDiTPipeline":
        """diffusers' ``from_pipe``, the transformer included: diffusers carries a model over only when
        its class is the annotation's, and this file names no model class."""
        return super().from_pipe(pipeline, **{"transformer": pipeline.transformer, **kwargs})

    @classmethod
    def load_config(cls, *args: Any, **kwargs: Any):
        """An exported folder names its own files, ``["pipeline_moh_dit", "MoHDiTPipeline"]`` and the
        transformer's ``["transformer_moh_dit", ...]``, for ``DiffusionPipeline.from_pretrained(...,
        trust_remote_code=True)``. Loaded through this class, this class and the installed model class
        are used instead, and none of the folder's code runs."""
        loaded = super().load_config(*args, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        if isinstance(config.get("_class_name"), list):
            config["_class_name"] = config["_class_name"][1]
            if config.get("transformer", [None])[0] == "transformer_moh_dit":
                config["transformer"] = ["moh_dit.models.transformer_moh_dit", config["transformer"][1]]
        return loaded

    @classmethod
    def lora_state_dict(cls, pretrained_model_name_or_path_or_dict, **kwargs: Any):
        """diffusers' reader, also of what ``pipe.transformer.save_lora_adapter`` wrote: its keys lack
        the ``transformer.`` prefix, and diffusers would load nothing."""
        loaded = super().lora_state_dict(pretrained_model_name_or_path_or_dict, **kwargs)
        state_dict, metadata = loaded if isinstance(loaded, tuple) else (loaded, None)
        if state_dict and not any(key.startswith("transformer.") for key in state_dict):
            state_dict = {f"transformer.{key}": value for key, value in state_dict.items()}
            metadata = {f"transformer.{key}": value for key, value in metadata.items()} if metadata else metadata
        return (state_dict, metadata) if isinstance(loaded, tuple) else state_dict

    # ------------------------------------------------------------------ labels
    @property
    def id2label(self) -> dict[int, str]:
        return {int(k): v for k, v in (self.config.id2label or {}).items()}

    @property
    def labels(self) -> dict[str, int]:
        """Name -> class id, each comma-separated part of a name too (``"tench, Tinca tinca"``), as
        DiTPipeline reads them."""
        return dict(sorted((part.strip(), i) for i, name in self.id2label.items() for part in name.split(",")))

    def get_label_ids(self, label: str | int | Sequence[Any]) -> list[int]:
        """Class ids of names and/or ids, nested lists and tensors flattened. A name matches exactly,
        else case-insensitively when that is unambiguous."""
        labels, ids = self.labels, []
        for item in _flatten(label):
            if isinstance(item, numbers.Integral):
                ids.append(int(item))
                continue
            if not isinstance(item, str):
                raise ValueError(f"class label {item!r} is neither a class id nor a name.")
            key = item.strip()
            found = [key] if key in labels else [n for n in labels if n.casefold() == key.casefold()]
            if len(found) != 1:
                raise ValueError(f"class name {item!r} is {'ambiguous' if found else 'unknown'} (names: pipe.labels); "
                                 f"pass its id.")
            ids.append(labels[found[0]])
        return ids

    # ------------------------------------------------------------------ diffusers' call state
    @property
    def guidance_scale(self) -> float:
        return self._guidance_scale

    @property
    def do_classifier_free_guidance(self) -> bool:
        """Whether the next step guides: a callback may change ``_guidance_scale`` between steps."""
        return self._guidance_scale > 1

    @property
    def num_timesteps(self) -> int:
        return self._num_timesteps

    @property
    def interrupt(self) -> bool:
        """``pipe._interrupt = True`` (in a callback) skips the remaining steps."""
        return self._interrupt

    # ------------------------------------------------------------------ checks
    def _takes_variance(self) -> bool:
        """Whether the scheduler's step takes the variance channels: only DDPM with a learned range
        (DiT's sampler), decided by its class, not by a key ``from_config`` carried over."""
        name, config = type(self.scheduler).__name__, self.scheduler.config
        if not hasattr(self.scheduler, "alphas_cumprod") or config.get("prediction_type", "epsilon") != "epsilon":
            raise ValueError(f"{name} does not sample an eps-predicting DDPM model; use an eps-prediction DDPM-family "
                             "scheduler, e.g. DDIMScheduler.from_config(pipe.scheduler.config, "
                             "prediction_type='epsilon').")
        variance = config.get("variance_type")
        if type(self.scheduler) is not DDPMScheduler or variance not in ("learned", "learned_range"):
            return False
        model = self.transformer.config
        out_channels = model.out_channels or model.in_channels * (2 if model.learn_sigma else 1)
        learns_sigma = out_channels == 2 * model.in_channels
        if variance == "learned" or not learns_sigma:
            raise ValueError(f"{name}(variance_type={variance!r}) cannot read this model's output (learn_sigma="
                             f"{learns_sigma}); use variance_type='learned_range' for a model that learns sigma, "
                             "'fixed_small' for one that does not.")
        return True

    def check_inputs(self, class_labels: Any, guidance_scale: float, num_inference_steps: int | None,
                     head_activation_ratio: Any = None, generator: Any = None, seeds: Sequence[int] | None = None,
                     latents: torch.Tensor | None = None, guidance_channels: str = "all",
                     timesteps: Sequence[int] | None = None, eta: float = 0.0, output_type: str = "pil",
                     callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",)) -> list[float] | None:
        """The one check of a call's arguments, before any compute; ValueError naming the argument.
        Returns each step's requested head activation ratio (None: one ratio for the call)."""
        config = self.transformer.config
        ids = self.get_label_ids(class_labels)
        if not ids or not all(0 <= i <= config.num_classes for i in ids):
            raise ValueError(f"class_labels={ids}: give class ids in [0, {config.num_classes - 1}] (or "
                             f"{config.num_classes}, the null class, for unconditional samples).")
        if not (isinstance(guidance_scale, numbers.Real) and 1 <= guidance_scale < math.inf):
            raise ValueError(f"guidance_scale={guidance_scale!r} must be a finite number >= 1 (1: no guidance).")
        if not (isinstance(eta, numbers.Real) and 0 <= eta <= 1):
            raise ValueError(f"eta={eta!r} must be in [0, 1] (DDIM's eta).")
        if guidance_channels not in ("all", "dit") or output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"guidance_channels={guidance_channels!r} (all or dit), output_type={output_type!r} "
                             "(pil, np, pt or latent).")
        if output_type != "latent" and self.vae is None and config.in_channels not in (1, 3):
            raise ValueError(f"the transformer takes {config.in_channels}-channel latents: build the pipeline with "
                             "its VAE, or use output_type='latent'.")
        if not set(callback_on_step_end_tensor_inputs) <= set(self._callback_tensor_inputs):
            raise ValueError(f"callback_on_step_end_tensor_inputs={list(callback_on_step_end_tensor_inputs)}; choose "
                             f"from {self._callback_tensor_inputs}.")
        if seeds is not None and (generator is not None or len(seeds) != len(ids)):
            raise ValueError(f"seeds: give one seed per image ({len(ids)}) and no generator.")
        if isinstance(generator, list) and len(generator) != len(ids):
            raise ValueError(f"generator: give one generator per image ({len(ids)}), or one.")
        shape = (len(ids), config.in_channels, config.sample_size, config.sample_size)
        if latents is not None and tuple(latents.shape) != shape:
            raise ValueError(f"latents has shape {tuple(latents.shape)}; this call needs {shape}.")
        self._takes_variance()
        train_steps = self.scheduler.config.num_train_timesteps
        if timesteps is None and not (isinstance(num_inference_steps, int) and 1 <= num_inference_steps <= train_steps):
            raise ValueError(f"num_inference_steps={num_inference_steps!r} must be an int in [1, {train_steps}].")
        if timesteps is not None:
            steps = [int(t) for t in timesteps]
            if not (steps and all(a > b for a, b in zip(steps, steps[1:])) and 0 <= steps[-1] <= steps[0] < train_steps
                    and "timesteps" in inspect.signature(self.scheduler.set_timesteps).parameters):
                raise ValueError(f"timesteps={steps[:5]}...: give descending steps in [0, {train_steps - 1}] to a "
                                 "scheduler that takes them (DDPM, DPM-Solver).")
        ratios = self._step_ratios(head_activation_ratio, num_inference_steps, timesteps)
        # the model's range check, for every step's ratio, before the first step
        saved = self.transformer.head_activation_ratio
        try:
            for ratio in ratios or ([] if head_activation_ratio is None else [head_activation_ratio]):
                self.transformer.set_head_activation_ratio(ratio)
        finally:
            self.transformer.set_head_activation_ratio(saved)
        return ratios

    def _step_ratios(self, ratio: Any, num_inference_steps: int | None,
                     timesteps: Sequence[int] | None) -> list[float] | None:
        """Each step's ratio of a schedule: ``"linear:A:B"`` (A at the first, noisiest step to B at the
        last), one ratio per step, or a function of the timestep. None for one ratio (or None)."""
        if ratio is None or isinstance(ratio, numbers.Real):
            return None
        scheduler = copy.deepcopy(self.scheduler)  # the call's timesteps, from a copy
        if timesteps is None:
            scheduler.set_timesteps(num_inference_steps)
        else:
            scheduler.set_timesteps(timesteps=[int(t) for t in timesteps])
        steps = [t.item() for t in scheduler.timesteps]
        n = len(steps)
        if isinstance(ratio, str):
            kind, first, last = ratio.split(":") if ratio.count(":") == 2 else ("", 0, 0)
            if kind.strip().lower() != "linear":
                raise ValueError(f"head_activation_ratio={ratio!r}: the text form is linear:FIRST:LAST.")
            first, last = float(first), float(last)
            return [first + (last - first) * (i / (n - 1) if n > 1 else 0.0) for i in range(n)]
        if callable(ratio):
            return [float(ratio(int(t) if float(t).is_integer() else t)) for t in steps]
        ratios = [float(r) for r in ratio]
        if len(ratios) != n:
            raise ValueError(f"head_activation_ratio has {len(ratios)} per-step ratios for {n} steps; give one per "
                             "step.")
        return ratios

    # ------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(
        self,
        class_labels: int | str | Sequence[Any] | torch.Tensor,
        guidance_scale: float = 4.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        num_inference_steps: int = 50,
        output_type: str = "pil",
        return_dict: bool = True,
        *,
        head_activation_ratio: float | str | Sequence[float] | Callable[[int], float] | None = None,
        seeds: Sequence[int] | None = None,
        latents: torch.Tensor | None = None,
        guidance_channels: str = "all",
        timesteps: Sequence[int] | None = None,
        eta: float = 0.0,
        output_head_usage: bool = True,
        callback_on_step_end: Callable[..., dict[str, Any]] | PipelineCallback | MultiPipelineCallbacks | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    ) -> MoHDiTPipelineOutput | tuple:
        r"""Generate one image per class label.

        Args:
            class_labels: class ids and/or names; nested lists are flattened. Id ``num_classes``
                (the null class) gives an unconditional sample.
            guidance_scale: classifier-free guidance scale; 1 turns guidance (and the unconditional
                half of the batch) off. 4.0 is DiT's default for pictures; FID numbers use 1.5 or 1.
            generator: a ``torch.Generator`` or one per image.
            num_inference_steps: sampling steps (the paper's FID: 250 DDPM steps).
            output_type: ``"pil"``, ``"np"``, ``"pt"`` (images in [0, 1]) or ``"latent"``.
            return_dict: a ``MoHDiTPipelineOutput``, else ``(images,)``.
            head_activation_ratio: routed top-K for this call, restored afterwards (None: the
                model's current setting). A number, or one per step: ``"linear:A:B"`` (A at the
                first, noisiest step to B at the last), a list of one ratio per step, or a function
                of the timestep. Every step's ratio is checked before the first step.
            seeds: one seed per image instead of ``generator``: each image's own generator draws
                its initial noise and every DDPM step's noise, so image ``i`` is the same for any
                batch size.
            latents: initial noise (B, C, H, W) instead of drawing it.
            guidance_channels: ``"all"`` guides every eps channel (DiTPipeline); ``"dit"`` only the
                first three, as DiT's sampler and the paper's cfg numbers do. Variance channels come
                from the conditional half either way.
            timesteps: explicit descending timesteps (DDPM, DPM-Solver), e.g. ADM's ``space_timesteps``.
            eta: DDIM's eta.
            output_head_usage: return the run's per-layer head usage; off, the transformer computes no
                routing statistics (the images are the same).
            callback_on_step_end: diffusers' step callback ``(pipe, step_index, timestep, kwargs)``;
                the ``"latents"`` it returns replace the latents. It may change
                ``pipe._guidance_scale`` for the next steps or stop with ``pipe._interrupt = True``.
            callback_on_step_end_tensor_inputs: names from ``_callback_tensor_inputs``.
        """
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        step_ratios = self.check_inputs(class_labels, guidance_scale, num_inference_steps, head_activation_ratio,
                                        generator, seeds, latents, guidance_channels, timesteps, eta, output_type,
                                        callback_on_step_end_tensor_inputs)
        model, config, device = self.transformer, self.transformer.config, self._execution_device
        if seeds is not None:
            generator = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
        labels = torch.tensor(self.get_label_ids(class_labels), device=device)  # (B,)
        num_guided = config.in_channels if guidance_channels == "all" else min(3, config.in_channels)
        takes_variance = self._takes_variance()
        step_kwargs = {}
        params = inspect.signature(self.scheduler.step).parameters
        if "generator" in params:
            step_kwargs["generator"] = generator
        if "eta" in params:
            step_kwargs["eta"] = eta
        # IDDPM's clipped DDIM re-derives eps from the clipped x0; diffusers' does so only when asked
        if "use_clipped_model_output" in params and (self.scheduler.config.get("clip_sample")
                                                      or self.scheduler.config.get("thresholding")):
            step_kwargs["use_clipped_model_output"] = True
        self._guidance_scale, self._interrupt = float(guidance_scale), False
        if timesteps is None:
            self.scheduler.set_timesteps(num_inference_steps)
        else:
            self.scheduler.set_timesteps(timesteps=[int(t) for t in timesteps])
        self._num_timesteps = len(self.scheduler.timesteps)
        if latents is None:  # float32 state whatever the model's dtype: the sampler's arithmetic stays exact
            latents = randn_tensor((len(labels), config.in_channels, config.sample_size, config.sample_size),
                                   generator=generator, device=device, dtype=torch.float32)
        x = latents.to(device=device, dtype=torch.float32) * self.scheduler.init_noise_sigma  # (B, C, H, W)

        # A scheduler handed the eps half must not see a learned variance_type (DPM-Solver would cut
        # the output to 3 channels); the config, the model's mode and its ratio are given back.
        stale = self.scheduler.config.get("variance_type")
        hide = not takes_variance and stale in ("learned", "learned_range")
        saved_ratio, was_training = model.head_activation_ratio, model.training
        ratios, usage = [], None
        try:
            if hide:
                self.scheduler.register_to_config(variance_type=None)
            model.eval()
            if head_activation_ratio is not None and step_ratios is None:
                model.set_head_activation_ratio(head_activation_ratio)
            for index, t in enumerate(self.progress_bar(self.scheduler.timesteps)):
                if self.interrupt:
                    continue
                if step_ratios is not None:
                    model.set_head_activation_ratio(step_ratios[index])
                ratios.append(model.head_activation_ratio)
                guided = self.do_classifier_free_guidance
                model_in = torch.cat([x, x]) if guided else x  # (B or 2B, C, H, W)
                y = torch.cat([labels, torch.full_like(labels, config.num_classes)]) if guided else labels
                model_in = self.scheduler.scale_model_input(model_in, t)
                t_in = torch.as_tensor(t, device=device).reshape(1).expand(model_in.shape[0])
                out = model(model_in.to(model.dtype), timestep=t_in, class_labels=y,
                            output_head_usage=output_head_usage)
                pred = out.sample.float()  # (B or 2B, C or 2C, H, W)
                if guided:
                    cond, uncond = pred.chunk(2)
                    cond, uncond, rest = cond[:, :num_guided], uncond[:, :num_guided], cond[:, num_guided:]
                    eps = uncond + self._guidance_scale * (cond - uncond)  # (B, guided channels, H, W)
                    pred = torch.cat([eps, rest], dim=1)  # (B, C or 2C, H, W)
                if not takes_variance:
                    pred = pred[:, :config.in_channels]
                x = self.scheduler.step(pred, t, x, **step_kwargs).prev_sample
                if callback_on_step_end is not None:
                    tensors = {"latents": x}
                    inputs = {k: tensors[k] for k in callback_on_step_end_tensor_inputs}
                    outputs = callback_on_step_end(self, index, t, inputs)
                    x = outputs.pop("latents", x)
                if output_head_usage:
                    used = [u.float() for u in out.head_usage]
                    usage = used if usage is None else [s + u for s, u in zip(usage, used)]
        finally:
            if hide:
                self.scheduler.register_to_config(variance_type=stale)
            model.set_head_activation_ratio(saved_ratio)
            model.train(was_training)

        images = x if output_type == "latent" else self._decode(x, output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        head_usage = [(u / len(ratios)).cpu() for u in usage or []] if output_head_usage else None
        return MoHDiTPipelineOutput(images=images, head_activation_ratio=sum(ratios) / len(ratios),
                                    head_usage=head_usage, head_activation_ratios=ratios)

    def _decode(self, latents: torch.Tensor, output_type: str):
        """Final latents -> images in [0, 1] as ``output_type`` (the identity map for pixel models)."""
        images = latents
        if self.vae is not None:
            latents = latents / self.vae.config.scaling_factor + (self.vae.config.get("shift_factor") or 0)
            images = self.vae.decode(latents.to(self.vae.dtype)).sample
        images = (images.float() / 2 + 0.5).clamp(0, 1)  # (B, C, H, W)
        if output_type == "pt":
            return images
        images = images.cpu().permute(0, 2, 3, 1).numpy()  # (B, H, W, C)
        return self.numpy_to_pil(images) if output_type == "pil" else images
