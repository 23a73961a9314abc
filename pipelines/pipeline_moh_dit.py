"""``MoHDiTPipeline``: class-conditional sampling from a MoH-DiT (or dense DiT) transformer.

Follows diffusers' ``DiTPipeline`` (one ``__call__``, ``randn_tensor`` with generators,
``progress_bar``, model CPU offload) and fixes what it lacks for this project:

* the null class comes from the model config (``num_classes``), not a hard-coded 1000;
* ``id2label`` is part of the pipeline config, so it is saved in ``model_index.json`` and
  restored; labels can be given as names (case-insensitive, close names suggested; see
  :mod:`moh_dit.pipelines.labels`);
* classifier-free guidance on all eps channels (diffusers) or on the first three (the
  original DiT sampler), the variance channels always taken from the conditional half;
* any eps-prediction diffusers scheduler, swapped the diffusers way
  (``pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)``): DDPM's step gets the
  learned-range variance channels (the paper's 250-step sampler), every other one the eps half
  (:func:`moh_dit.diffusion.schedulers.scheduler_takes_variance`);
* ``head_activation_ratio`` per call (restored afterwards), also as a schedule (a ratio per
  denoising step: :mod:`moh_dit.models.head_schedule`), with the realised per-step ratios and the
  mean attention FLOPs on the output, and, on request, the run's head usage;
* ``seeds``: one seed per image for the initial noise *and* every DDPM step's noise, so
  image ``i`` does not depend on the batch it was drawn in;
* pixel-space models (no VAE) as well as latent ones;
* NaN / inf latents raise an error naming the first bad step (:mod:`moh_dit.pipelines.finite_watch`);
* diffusers' conventions where users extend a pipeline: the call's state as properties that a step
  callback reads and changes (``guidance_scale``, ``num_timesteps``, ``_interrupt``), and LoRA
  loading on the pipeline (``load_lora_weights``, ... via :class:`MoHDiTLoraLoaderMixin`).

The module path ``moh_dit.pipelines.pipeline_moh_dit`` is written into saved
``model_index.json`` files; keep it stable.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import PIL.Image
import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
# diffusers.loaders exports its pipeline LoRA mixins only when transformers is installed; the module
# itself needs neither transformers nor peft, so import it from there.
from diffusers.loaders.lora_pipeline import SanaLoraLoaderMixin
from diffusers.models import AutoencoderKL
from diffusers.models.modeling_utils import ModelMixin
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor

# make_scheduler, imagenet_id2label and NonFiniteLatentsError are also imported from here by scripts
# and user code; they are defined in the modules they belong to.
from moh_dit.diffusion.schedulers import eps_only_config, make_scheduler, scheduler_takes_variance
from moh_dit.errors import InvalidInput
from moh_dit.hub.export_format import load_export_components, read_export_index, write_loader_file
from moh_dit.models.flops import model_attention_flops
from moh_dit.models.head_activation import head_activation
from moh_dit.models.head_schedule import HeadActivationPlan, HeadActivationSchedule, as_schedule, plan_head_activation
from moh_dit.models.transformer_moh_dit import MoHDiTTransformer2DModel
from .finite_watch import FiniteWatch, NonFiniteLatentsError
from .labels import LabelIndex, imagenet_id2label, resolve_id2label

__all__ = [
    "MoHDiTPipeline",
    "MoHDiTPipelineOutput",
    "MoHDiTLoraLoaderMixin",
    "NonFiniteLatentsError",
    "make_scheduler",
    "imagenet_id2label",
    "GUIDANCE_CHANNELS",
]

GUIDANCE_CHANNELS = ("all", "dit")
OUTPUT_TYPES = ("pil", "np", "pt", "latent")
# torch.Generator.manual_seed accepts exactly this range.
SEED_RANGE = (-(2**63), 2**64 - 1)


def _is_schedule(value: Any) -> bool:
    """Whether a ``head_activation_ratio`` asks for a schedule (a ratio per step) rather than one ratio."""
    return (isinstance(value, (str, list, tuple, np.ndarray, HeadActivationSchedule)) or callable(value)
            or (torch.is_tensor(value) and value.numel() != 1))


def _real(value: Any) -> float | None:
    """``value`` as a float if it is a real number (not a bool, not a string), else None."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require(ok: bool, parameters: str | tuple[str, ...], message: str) -> None:
    """Raise :class:`~moh_dit.errors.InvalidInput` with ``message``, which names ``parameters``, unless ``ok``."""
    if not ok:
        raise InvalidInput(message, parameters=parameters)


@dataclass
class MoHDiTPipelineOutput(BaseOutput):
    """Output of ``MoHDiTPipeline``.

    Args:
        images: ``PIL.Image`` list, (B, H, W, C) float numpy array in [0, 1], a (B, C, H, W)
            tensor in [0, 1] (``"pt"``), or the final latents (``"latent"``).
        head_activation_ratio: the head-weighted activation ratio the run used; for a schedule,
            the mean of the realised per-step ratios.
        head_usage: one (h_l,) float tensor per layer (CPU): the fraction of tokens that
            used each head, averaged over all transformer calls of the run (for guided runs
            this includes the unconditional half). Shared heads are 1.0. None when the call
            passed ``output_head_usage=False``.
        head_activation_ratios: the realised ratio of every denoising step, in order (all equal
            for a single ratio; a schedule's are rounded to the model's per-layer top-K).
        mean_attention_flops: ideal head-sparse attention FLOPs of one transformer forward pass
            for one image (``moh_dit.models.flops.model_attention_flops`` at each step's top-K),
            averaged over the steps; a guided step makes two such passes at the same ratio.
        mean_attention_flop_ratio: ``mean_attention_flops`` over the same model's dense attention
            FLOPs (every head active).
    """

    images: list[PIL.Image.Image] | np.ndarray | torch.Tensor
    head_activation_ratio: float
    head_usage: list[torch.Tensor] | None
    head_activation_ratios: list[float] | None = None
    mean_attention_flops: float | None = None
    mean_attention_flop_ratio: float | None = None


@dataclass
class _SamplingRun:
    """What every denoising step of one ``__call__`` needs, fixed before the first step. The
    guidance scale is not here: it is the pipeline's ``_guidance_scale``, which a step callback
    may change (diffusers' convention)."""

    ids: list[int]  # class ids of the B images
    labels: torch.Tensor  # (B,)
    num_guided: int  # eps channels that guidance acts on
    use_variance: bool  # the scheduler's step takes the variance channels (DDPM learned range)
    output_head_usage: bool  # the model computes its routing statistics only when asked
    step_kwargs: dict[str, Any]
    callback: Callable[..., dict[str, Any]] | None  # diffusers' callback_on_step_end
    callback_inputs: Sequence[str]
    step_ratios: list[float] | None = None  # a schedule's requested ratio per step (None: one ratio for the call)
    step_realised: list[float] = dataclasses.field(default_factory=list)  # what each step that ran ran at
    step_top_k: list[list[int]] = dataclasses.field(default_factory=list)


class MoHDiTLoraLoaderMixin(SanaLoraLoaderMixin):
    """LoRA on the pipeline, the diffusers way: ``load_lora_weights(path_or_dict, adapter_name=...)``,
    ``save_lora_weights(dir, transformer_lora_layers=...)`` (a classmethod), ``unload_lora_weights``,
    ``set_adapters``, ``fuse_lora`` / ``unfuse_lora``, ``get_active_adapters``, ...

    The transformer is the one component that carries a LoRA. diffusers' transformer-only loader does
    all the work (Sana's mixin is that loader, with no model-specific key conversion); it hands the
    weights to ``MoHDiTTransformer2DModel.load_lora_adapter``. Needs the optional ``peft`` when
    called, not when imported.
    """

    _lora_loadable_modules = ["transformer"]
    transformer_name = "transformer"

    @classmethod
    def lora_state_dict(cls, pretrained_model_name_or_path_or_dict, **kwargs: Any):
        """diffusers' reader, which also takes the transformer's own LoRA files: what
        ``pipe.transformer.save_lora_adapter`` writes has no ``transformer.`` prefix on its keys,
        which diffusers would skip with a warning, loading nothing."""
        loaded = super().lora_state_dict(pretrained_model_name_or_path_or_dict, **kwargs)
        state_dict, metadata = loaded if isinstance(loaded, tuple) else (loaded, None)
        prefix = f"{cls.transformer_name}."
        if state_dict and not any(key.startswith(prefix) for key in state_dict):
            state_dict = {prefix + key: value for key, value in state_dict.items()}
            metadata = {prefix + key: value for key, value in metadata.items()} if metadata else metadata
        return (state_dict, metadata) if isinstance(loaded, tuple) else state_dict


class MoHDiTPipeline(DiffusionPipeline, MoHDiTLoraLoaderMixin):
    r"""Class-conditional image generation with a ``MoHDiTTransformer2DModel``.

    Args:
        transformer: the MoH-DiT (or dense DiT) model; it predicts eps (and, with learned
            sigma, the variance values) for latents or, without a VAE, for images in [-1, 1].
        scheduler: a diffusers scheduler; see :func:`make_scheduler` for the paper's DDPM.
        vae: an ``AutoencoderKL`` for latent models; None for pixel-space models.
        id2label: class id -> name; default: the model's ``config.class_names``, else the
            ImageNet-1k names for a 1000-class model, else none. Saved with the pipeline.

    Examples:

    ```py
    >>> import torch
    >>> from diffusers import AutoencoderKL
    >>> from moh_dit import MoHDiTPipeline, MoHDiTTransformer2DModel
    >>> from moh_dit.pipelines.pipeline_moh_dit import make_scheduler

    >>> transformer = MoHDiTTransformer2DModel.from_pretrained("moh-dit-xl-2-90")  # convert_checkpoint.py output
    >>> vae = AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-ema")
    >>> pipe = MoHDiTPipeline(transformer=transformer, vae=vae, scheduler=make_scheduler("ddpm")).to("cuda")
    >>> out = pipe(["golden retriever", "tench", 88], guidance_scale=1.5, num_inference_steps=250,
    ...            head_activation_ratio=0.8, seeds=[0, 1, 2])
    >>> out.images[0].save("golden_retriever.png")
    >>> out.head_activation_ratio, [u.mean().item() for u in out.head_usage][:3]
    >>> out = pipe(["tench"], head_activation_ratio="step:0.5@t>500,1.0", seeds=[0])  # a ratio per step
    >>> out.head_activation_ratios[:3], out.mean_attention_flops
    >>> from diffusers import DPMSolverMultistepScheduler  # any eps-prediction scheduler, swapped the diffusers way
    >>> pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    >>> images = pipe(["tench"], num_inference_steps=25, seeds=[0]).images
    >>> pipe.save_pretrained("moh-dit-xl-2-90-pipeline")  # transformer, VAE, scheduler, id2label
    >>> pipe.load_lora_weights("my-lora-folder", adapter_name="style")  # diffusers' LoRA API (needs peft)
    >>> pipe.unload_lora_weights()
    ```
    """

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["vae"]
    _callback_tensor_inputs = ["latents"]

    def __init__(
        self,
        # ModelMixin too: in an exported folder the transformer comes from its own module file (a class
        # object of its own), which diffusers checks against this annotation; from_pipe needs the exact class.
        transformer: MoHDiTTransformer2DModel | ModelMixin,
        scheduler: SchedulerMixin,
        vae: AutoencoderKL | None = None,
        id2label: dict[int, str] | dict[str, str] | None = None,  # diffusers' type check cannot read dict[int | str, str]
    ):
        super().__init__()
        channels = transformer.config.in_channels
        if vae is not None and vae.config.latent_channels != channels:
            raise InvalidInput(f"The VAE has {vae.config.latent_channels} latent channels but the transformer takes "
                               f"in_channels={channels}.", parameters="vae")
        _require(vae is not None or channels in (1, 3), "vae", f"The transformer takes {channels}-channel inputs, so it is "
                 "a latent model: pass its VAE (e.g. AutoencoderKL.from_pretrained('stabilityai/sd-vae-ft-ema')). "
                 "Pixel-space models have 1 or 3 channels.")
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)
        table = resolve_id2label(id2label, transformer.config)
        # JSON keys are strings; store them that way so a reloaded config equals the saved one.
        self.register_to_config(id2label=None if table is None else {str(k): v for k, v in table.items()})
        self._label_index = LabelIndex(table or {})

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs: Any) -> "MoHDiTPipeline":
        """``DiffusionPipeline.from_pretrained``, which also loads folders that name a module file.

        Folders written by :meth:`save_pretrained` or by ``moh_dit.hub.export`` name the pipeline's
        module file in their ``model_index.json``, so that ``DiffusionPipeline.from_pretrained(folder,
        trust_remote_code=True)`` loads them. Called on this class, none of the folder's code runs: a
        ``save_pretrained`` folder loads through diffusers with every argument it takes; an export
        (whose transformer is also a module file) loads with this package's classes and takes
        ``torch_dtype`` (or ``dtype``), ``variant`` and ready ``transformer`` / ``scheduler`` / ``vae`` /
        ``id2label``; other arguments raise TypeError.
        """
        index = read_export_index(pretrained_model_name_or_path)
        if index is None or str(index.get("transformer", [""])[0]).startswith("moh_dit"):  # not a self-contained export
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        pipe = cls(**load_export_components(pretrained_model_name_or_path, index, kwargs))
        pipe.register_to_config(_name_or_path=str(pretrained_model_name_or_path))
        return pipe

    @classmethod
    def load_config(cls, *args: Any, **kwargs: Any):
        """``ConfigMixin.load_config``, with a ``_class_name`` that names a module file read as the
        plain class name: loading through this class then uses the class itself (every
        ``from_pretrained`` argument, none of the folder's code run) instead of the folder's file."""
        loaded = super().load_config(*args, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        if isinstance(config.get("_class_name"), list):
            config["_class_name"] = config["_class_name"][1]
        return loaded

    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any) -> None:
        """``DiffusionPipeline.save_pretrained``, plus a module file that lets
        ``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` find this class in the
        installed moh-dit (diffusers looks a plain class name up in ``diffusers`` itself)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        write_loader_file(save_directory, type(self).__name__)

    # ------------------------------------------------------------------ state of the running call
    # diffusers' pipeline state: set at the start of every ``__call__`` and read by every step, so
    # that a ``callback_on_step_end`` may change them (``pipe._guidance_scale = 0.0``, ``pipe._interrupt = True``).
    @property
    def guidance_scale(self) -> float:
        """The classifier-free guidance scale the next step uses (the call's, unless a callback changed it)."""
        return self._guidance_scale

    @property
    def do_classifier_free_guidance(self) -> bool:
        """Whether the next step guides (``guidance_scale > 1``): with the unconditional half in the batch."""
        return self._guidance_scale > 1

    @property
    def num_timesteps(self) -> int:
        """The number of denoising steps of the call."""
        return self._num_timesteps

    @property
    def interrupt(self) -> bool:
        """Set (``pipe._interrupt = True``, e.g. in a callback) to skip the call's remaining steps."""
        return self._interrupt

    # ------------------------------------------------------------------ labels
    @property
    def id2label(self) -> dict[int, str]:
        """Class id -> name (empty if the pipeline has no names)."""
        return {int(k): v for k, v in (self.config.id2label or {}).items()}

    @property
    def labels(self) -> dict[str, int]:
        """Every unambiguous name (and synonym) -> class id, sorted by name."""
        return self._label_index.labels

    def get_label_ids(self, label: str | int | Sequence[str | int]) -> list[int]:
        """Map names (case-insensitive) and/or class ids to class ids, validating each.

        The null class id (``num_classes``) is accepted and gives unconditional samples.
        Raises ValueError for an unknown name (with close names), an ambiguous one, an id
        out of range, or an empty list.
        """
        return self._label_index.ids(label, self.transformer.config.num_classes)

    # ------------------------------------------------------------------ input checks
    def check_inputs(
        self,
        class_labels: int | str | Sequence[int | str] | torch.Tensor,
        guidance_scale: float,
        num_inference_steps: int | None,
        head_activation_ratio: Any = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        seeds: Sequence[int] | None = None,
        latents: torch.Tensor | None = None,
        guidance_channels: str = "all",
        timesteps: Sequence[int] | None = None,
        eta: float = 0.0,
        output_type: str = "pil",
        callback_on_step_end_tensor_inputs: Sequence[str] | None = None,
    ) -> HeadActivationPlan | None:
        """Check a ``__call__``'s arguments against this pipeline's model and scheduler, running
        nothing (diffusers' ``check_inputs``): :class:`~moh_dit.errors.InvalidInput` names the
        parameter (``parameters``), so that a command can show it as its flag.

        The one check of a call's inputs: ``__call__`` makes it first, and ``moh-dit sample`` once
        before it writes anything. Returns what a head-activation schedule realises on the call's
        steps (every step's ratio checked), the plan ``__call__`` then runs; None for one ratio.
        """
        batch = len(self.get_label_ids(class_labels))
        scale, eta_value = _real(guidance_scale), _real(eta)
        # inf would make every latent NaN (inf * 0 in the guided difference): black images.
        _require(scale is not None and math.isfinite(scale) and scale >= 1, "guidance_scale",
                 f"guidance_scale={guidance_scale!r} must be a finite number >= 1 (1 = no guidance; the null class "
                 f"id {self.transformer.config.num_classes} gives unconditional samples).")
        # DDIM's sigma grows with eta; past 1 the direction term's square root goes negative.
        _require(eta_value is not None and 0 <= eta_value <= 1, "eta",
                 f"eta={eta!r} must be a number in [0, 1] (DDIM's eta; 0 = deterministic).")
        _require(guidance_channels in GUIDANCE_CHANNELS, "guidance_channels",
                 f"guidance_channels={guidance_channels!r}; choose one of {GUIDANCE_CHANNELS}.")
        _require(output_type in OUTPUT_TYPES, "output_type", f"output_type={output_type!r}; choose one of {OUTPUT_TYPES}.")
        unknown = [k for k in callback_on_step_end_tensor_inputs or () if k not in self._callback_tensor_inputs]
        _require(not unknown, "callback_on_step_end_tensor_inputs", f"callback_on_step_end_tensor_inputs has {unknown}; "
                 f"choose from {self._callback_tensor_inputs}.")
        self._check_randomness(batch, generator, seeds)
        if latents is not None:
            size = self.transformer.config.sample_size
            shape, got = (batch, self.transformer.config.in_channels, size, size), getattr(latents, "shape", None)
            _require(torch.is_tensor(latents) and tuple(got) == shape, "latents",
                     f"latents must be a tensor of shape {shape}; got {type(latents).__name__} {got}.")
            # One host sync before the loop, not per step.
            _require(bool(torch.isfinite(latents).all()), "latents", "latents hold NaN or inf; pass finite initial noise.")
        self._takes_variance()  # a scheduler that cannot sample this model
        self._check_steps(num_inference_steps, timesteps)
        if _is_schedule(head_activation_ratio):
            return self._plan(head_activation_ratio, self.sampling_timesteps(num_inference_steps, timesteps))
        if head_activation_ratio is not None:
            ratio, (low, high) = _real(head_activation_ratio), self.transformer.head_activation_range
            _require(ratio is not None and math.isfinite(ratio) and low - 1e-9 <= ratio <= high + 1e-9,
                     "head_activation_ratio", f"head_activation_ratio={head_activation_ratio!r} is outside this model's "
                     f"reachable range [{low:.4f}, {high:.4f}].")
        return None

    def head_activation_plan(
        self,
        head_activation_ratio: Any,
        num_inference_steps: int | None = 50,
        timesteps: Sequence[int] | None = None,
    ) -> HeadActivationPlan:
        """What ``head_activation_ratio`` (a ratio or a schedule, as ``__call__`` takes it) realises
        over the trajectory of ``num_inference_steps`` (or ``timesteps``) with this pipeline's
        scheduler: per step the requested and realised ratio, the per-layer top-K and the attention
        FLOPs (:class:`~moh_dit.models.head_schedule.HeadActivationPlan`). Nothing runs on the model
        and the model and scheduler are left as they were; InvalidInput names the parameter (for a
        step out of the model's reachable range, the first such step)."""
        self._check_steps(num_inference_steps, timesteps)
        if head_activation_ratio is None:
            head_activation_ratio = HeadActivationSchedule.constant(self.transformer.head_activation_ratio)
        elif not _is_schedule(head_activation_ratio):
            ratio = _real(head_activation_ratio)
            _require(ratio is not None, "head_activation_ratio",
                     f"head_activation_ratio={head_activation_ratio!r} is not a number or a schedule.")
            head_activation_ratio = HeadActivationSchedule(f"{ratio:g}", lambda i, t, n: ratio)  # range checked per step
        return self._plan(head_activation_ratio, self.sampling_timesteps(num_inference_steps, timesteps))

    def _plan(self, head_activation_ratio: Any, timesteps: Sequence[int]) -> HeadActivationPlan:
        """``plan_head_activation`` of a schedule (as ``__call__`` takes it) over ``timesteps``; what
        is wrong with it (a step out of the model's range, a rule that gives no number) names the parameter."""
        try:
            return plan_head_activation(self.transformer, as_schedule(head_activation_ratio), timesteps)
        except ValueError as err:
            raise InvalidInput(f"head_activation_ratio: {err}", parameters="head_activation_ratio") from err

    def sampling_timesteps(self, num_inference_steps: int | None, timesteps: Sequence[int] | None) -> torch.Tensor:
        """The timesteps a call with these (checked) arguments runs, from a copy of the scheduler
        (whose ``set_timesteps`` is left for the call itself)."""
        scheduler = copy.deepcopy(self.scheduler)
        if timesteps is None:
            scheduler.set_timesteps(num_inference_steps)
        else:
            scheduler.set_timesteps(timesteps=[int(t) for t in timesteps])
        return scheduler.timesteps

    def _check_steps(self, num_inference_steps: int | None, timesteps: Sequence[int] | None) -> None:
        """``num_inference_steps`` (or the explicit ``timesteps``) within the model's diffusion steps."""
        train_steps = int(getattr(self.scheduler.config, "num_train_timesteps", 1000))
        if timesteps is None:
            _require(_is_integer(num_inference_steps) and num_inference_steps >= 1, "num_inference_steps",
                     f"num_inference_steps must be a positive int; got {num_inference_steps!r}.")
            _require(num_inference_steps <= train_steps, "num_inference_steps",
                     f"num_inference_steps={num_inference_steps} is more than the {train_steps} diffusion steps the "
                     f"model was trained with; use 1..{train_steps}.")
            return
        _require("timesteps" in inspect.signature(self.scheduler.set_timesteps).parameters, "timesteps",
                 f"{type(self.scheduler).__name__} does not accept custom timesteps; use num_inference_steps.")
        steps = list(timesteps.tolist() if hasattr(timesteps, "tolist") else timesteps)
        _require(bool(steps) and all(_is_integer(t) and 0 <= t < train_steps for t in steps)
                 and all(a > b for a, b in zip(steps, steps[1:])), "timesteps",
                 f"timesteps must be a non-empty list of strictly descending ints in [0, {train_steps - 1}] (the "
                 f"model's diffusion steps); got {steps[:8]}{' ...' if len(steps) > 8 else ''}.")

    @staticmethod
    def _check_randomness(batch: int, generator, seeds: Sequence[int] | None) -> None:
        """One seed (or one generator, when a list is given) per image; seeds in torch's range."""
        if seeds is not None:
            _require(generator is None, ("seeds", "generator"), "Pass either seeds or generator, not both.")
            seeds, (low, high) = list(seeds), SEED_RANGE
            bad = [seed for seed in seeds if not (_is_integer(seed) and low <= seed <= high)]
            _require(not bad, "seeds", f"seeds must be ints in [{low}, {high}] (torch.Generator's range); got {bad[:3]}.")
            _require(len(seeds) == batch, "seeds",
                     f"seeds has {len(seeds)} seeds for {batch} class labels; give one seed per image.")
        if isinstance(generator, list):
            _require(len(generator) == batch, "generator",
                     f"generator is a list of {len(generator)} for {batch} class labels; give one per image.")

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents -> images in [-1, 1] (B, C, H, W); the identity for pixel-space models."""
        if self.vae is None:
            return latents
        latents = latents / self.vae.config.scaling_factor
        shift = getattr(self.vae.config, "shift_factor", None)
        if shift:
            latents = latents + shift
        return self.vae.decode(latents.to(self.vae.dtype)).sample

    # ------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(
        self,
        class_labels: int | str | Sequence[int | str] | torch.Tensor,
        guidance_scale: float = 4.0,
        num_inference_steps: int = 50,
        head_activation_ratio: float | str | Sequence[float] | Callable[[int], float] | HeadActivationSchedule | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        seeds: Sequence[int] | None = None,
        latents: torch.Tensor | None = None,
        guidance_channels: str = "all",
        timesteps: Sequence[int] | None = None,
        eta: float = 0.0,
        output_type: str = "pil",
        return_dict: bool = True,
        output_head_usage: bool = True,
        callback_on_step_end: Callable[..., dict[str, Any]] | PipelineCallback | MultiPipelineCallbacks | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    ) -> MoHDiTPipelineOutput | tuple:
        r"""Generate one image per class label.

        Args:
            class_labels: class ids and/or names (case-insensitive); id ``num_classes`` (the
                null class) gives an unconditional sample.
            guidance_scale: classifier-free guidance scale; 1 disables guidance (and the
                unconditional half of the batch). The default 4.0 is DiT's sample.py and
                DiTPipeline's (for pictures); the papers' FID numbers use 1.5 or 1.
            num_inference_steps: sampling steps; 50 like diffusers' DiTPipeline (the paper's FID
                numbers use 250 DDPM steps).
            head_activation_ratio: routed top-K for this call only (see
                ``MoHDiTTransformer2DModel.set_head_activation_ratio``); None: the model's
                current setting. Restored afterwards. A schedule sets it before every step: a
                spec string (``"linear:0.5:1.0"``, ``"cosine:1.0:0.5"``, ``"step:0.5@t>500,1.0"``),
                one ratio per step, a function of the timestep, or a
                ``HeadActivationSchedule`` (e.g. ``HeadActivationSchedule.of_fraction(f)``, a
                function of the step's fraction of the trajectory). Every step's ratio is
                checked against the model's range before the first step; the realised per-step
                ratios are ``head_activation_ratios`` on the output.
            generator: a ``torch.Generator`` or one per image (diffusers convention).
            seeds: one seed per image instead of ``generator``: each image gets its own CPU
                generator for its initial noise and for the noise of every DDPM step, so
                image ``i`` is the same whatever the batch size (what ``moh-dit sample`` uses).
            latents: initial noise (B, C, H, W) instead of drawing it.
            guidance_channels: ``"all"`` guides every eps channel (diffusers' DiTPipeline);
                ``"dit"`` guides only the first three, as the original DiT sampler does (its
                ``forward_with_cfg``), which is what the paper's cfg numbers used. The
                variance channels come from the conditional half in both cases.
            timesteps: explicit descending timesteps (DDPM / DPM-Solver), e.g. ADM's
                ``space_timesteps`` for step counts where ``linspace`` differs.
            eta: DDIM's eta (ignored by other schedulers).
            output_type: ``"pil"``, ``"np"``, ``"pt"`` (images in [0, 1]) or ``"latent"``.
            return_dict: return a ``MoHDiTPipelineOutput``; else ``(images,)``, as every diffusers
                pipeline does (the head usage and the realised ratio are on the output object only).
            output_head_usage: return the run's per-layer head usage (on by default, so that
                ``out.head_usage`` is at hand when trying a model). Off, the transformer computes
                no routing statistics at any step and ``head_usage`` is None; the images are
                the same. Sampling at scale (``moh_dit.sampling.sample.generate_batch``) turns
                it off.
            callback_on_step_end: diffusers' step callback, called after each scheduler step as
                ``callback(pipe, step_index, timestep, callback_kwargs)`` with the tensors named in
                ``callback_on_step_end_tensor_inputs``; the ``"latents"`` of the dict it returns
                replace the latents. A ``PipelineCallback`` brings its own ``tensor_inputs``. It may
                read ``pipe.guidance_scale``, ``pipe.do_classifier_free_guidance`` and
                ``pipe.num_timesteps``, change the guidance of the following steps with
                ``pipe._guidance_scale`` (1 or less drops the unconditional half; above 1 adds it),
                and stop the run with ``pipe._interrupt = True``: the remaining steps are skipped and
                the output is the latents after the last step that ran, decoded as usual, with
                ``head_activation_ratios`` and the FLOPs of the steps that ran.
            callback_on_step_end_tensor_inputs: names from ``_callback_tensor_inputs``.

        Raises:
            InvalidInput: (a ValueError) a bad argument, named (see :meth:`check_inputs`), before any compute.
            NonFiniteLatentsError: (a ValueError) the latents became NaN/inf; the message names
                the first bad step and its timestep. Checked at every step on the CPU, and on
                accelerators through a flag kept on the device and read once after the loop,
                so that sampling makes no per-step host sync (see ``FiniteWatch``).
        """
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        plan = self.check_inputs(  # a schedule's plan, made once
            class_labels, guidance_scale, num_inference_steps, head_activation_ratio=head_activation_ratio,
            generator=generator, seeds=seeds, latents=latents, guidance_channels=guidance_channels,
            timesteps=timesteps, eta=eta, output_type=output_type,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )
        if seeds is not None:
            generator = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
        self._guidance_scale = float(guidance_scale)
        self._interrupt = False
        run = self._prepare_run(self.get_label_ids(class_labels), guidance_channels, generator, eta,
                                bool(output_head_usage), callback_on_step_end, callback_on_step_end_tensor_inputs)
        if timesteps is None:
            self.scheduler.set_timesteps(num_inference_steps)
        else:
            self.scheduler.set_timesteps(timesteps=[int(t) for t in timesteps])
        self._num_timesteps = len(self.scheduler.timesteps)
        x = self._initial_latents(len(run.ids), generator, latents)
        scheduled = plan is not None
        if scheduled:  # planned by check_inputs on these timesteps
            run.step_ratios = plan.requested
        with self._sampling_state(None if scheduled else head_activation_ratio, run.use_variance) as realised:
            x, head_usage, watch = self._denoise(run, x)
        error = watch.error(self.scheduler.timesteps, self._guidance_scale)
        if error is not None:
            self.maybe_free_model_hooks()
            raise error
        images = self._output_images(x, output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        flops = {tuple(k): model_attention_flops(self.transformer, k) for k in run.step_top_k}  # (sparse, dense)
        mean_flops = sum(flops[tuple(k)][0] for k in run.step_top_k) / len(run.step_top_k)
        return MoHDiTPipelineOutput(
            images=images, head_activation_ratio=sum(run.step_realised) / len(run.step_realised) if scheduled else realised,
            head_usage=head_usage, head_activation_ratios=list(run.step_realised), mean_attention_flops=mean_flops,
            mean_attention_flop_ratio=mean_flops / next(iter(flops.values()))[1],
        )

    # ------------------------------------------------------------------ the steps of a call
    @contextlib.contextmanager
    def _sampling_state(self, ratio: float | None, takes_variance: bool) -> Iterator[float]:
        """Eval mode (no label dropout), the requested routed top-K and an eps-only scheduler
        config for one call; all restored on exit, also on error."""
        model = self.transformer
        was_training = model.training
        try:
            with head_activation(model, ratio) as realised, eps_only_config(self.scheduler, takes_variance):
                model.eval()
                yield realised
        finally:
            model.train(was_training)

    def _takes_variance(self) -> bool:
        """Whether the scheduler's step takes the model's variance channels (DDPM learned range);
        ValueError, naming the scheduler and what to use, for one that cannot sample this model."""
        learns_sigma = self.transformer.out_channels == 2 * self.transformer.config.in_channels
        return scheduler_takes_variance(self.scheduler, learns_sigma)

    def _step_kwargs(self, generator, eta: float) -> dict[str, Any]:
        params = set(inspect.signature(self.scheduler.step).parameters)
        config = self.scheduler.config
        kwargs: dict[str, Any] = {}
        if "generator" in params:
            kwargs["generator"] = generator
        if "eta" in params:
            kwargs["eta"] = eta
        # IDDPM's DDIM with clip_denoised re-derives eps from the clipped x0; diffusers' DDIM does so
        # only when asked (otherwise it steps with the model's eps and a clipped x0, another sampler).
        if "use_clipped_model_output" in params and (config.get("clip_sample") or config.get("thresholding")):
            kwargs["use_clipped_model_output"] = True
        return kwargs

    def _prepare_run(
        self, ids: list[int], guidance_channels: str, generator, eta: float,
        output_head_usage: bool, callback, callback_inputs: Sequence[str],
    ) -> _SamplingRun:
        """What every denoising step of one call needs, fixed before the first."""
        channels = self.transformer.config.in_channels
        return _SamplingRun(
            ids=ids,
            labels=torch.tensor(ids, device=self._execution_device),
            num_guided=channels if guidance_channels == "all" else min(3, channels),
            use_variance=self._takes_variance(),
            output_head_usage=output_head_usage,
            step_kwargs=self._step_kwargs(generator, eta),
            callback=callback,
            callback_inputs=tuple(callback_inputs),
        )

    def _initial_latents(self, batch: int, generator, latents: torch.Tensor | None) -> torch.Tensor:
        """(B, C, H, W) float32 initial noise on the execution device: ``latents`` or drawn, times
        the scheduler's ``init_noise_sigma`` (1 for DDPM / DDIM / DPM-Solver; the largest sigma
        for Euler-type schedulers), as diffusers' pipelines prepare them.

        The state is kept in float32 whatever the model dtype: the sampler's arithmetic (and
        the noise draws, which must not depend on the compute dtype) stay exact."""
        channels, size = self.transformer.config.in_channels, self.transformer.config.sample_size
        device = self._execution_device
        if latents is None:
            latents = randn_tensor((batch, channels, size, size), generator=generator, device=device, dtype=torch.float32)
        return latents.to(device=device, dtype=torch.float32) * self.scheduler.init_noise_sigma

    def _denoise(self, run: _SamplingRun, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor] | None, FiniteWatch]:
        """The denoising loop over the scheduler's timesteps: the final (B, C, H, W) latents (after
        the last step that ran, when ``pipe._interrupt`` stopped the run), each layer's head usage
        averaged over the transformer calls (None unless the run asks for it), and the finite watch."""
        usage_sum: list[torch.Tensor] | None = None
        calls = 0
        watch = FiniteWatch(x.device, len(self.scheduler.timesteps))
        for index, t in enumerate(self.progress_bar(self.scheduler.timesteps)):
            if self.interrupt:  # diffusers' pipelines skip the remaining steps the same way
                continue
            if run.step_ratios is not None:  # a schedule: this step's top-K (restored by _sampling_state)
                self.transformer.set_head_activation_ratio(run.step_ratios[index])
            run.step_realised.append(self.transformer.head_activation_ratio)
            run.step_top_k.append(self.transformer.top_k_per_layer)
            x, used = self._denoise_step(run, x, t)
            if run.callback is not None:
                tensors = {"latents": x}  # the names of _callback_tensor_inputs
                outputs = run.callback(self, index, t, {name: tensors[name] for name in run.callback_inputs})
                x = outputs.pop("latents", x)
            if used is not None:
                usage_sum = used if usage_sum is None else [s + u for s, u in zip(usage_sum, used)]
            calls += 1
            if watch.update(index, x):
                break
        if not run.output_head_usage:
            return x, None, watch
        head_usage = [(s / calls).cpu() for s in usage_sum] if usage_sum is not None else []
        return x, head_usage, watch

    def _denoise_step(
        self, run: _SamplingRun, x: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """One transformer call (both halves when guided) and one scheduler step: the next
        (B, C, H, W) latents and this call's per-layer head usage (None unless asked for)."""
        channels, num_guided = self.transformer.config.in_channels, run.num_guided
        guided = self.do_classifier_free_guidance  # read every step: a callback may have changed the scale
        model_in = torch.cat([x, x]) if guided else x
        labels = torch.cat([run.labels, torch.full_like(run.labels, self.transformer.config.num_classes)]) \
            if guided else run.labels  # the null class for the unconditional half
        model_in = self.scheduler.scale_model_input(model_in, t)
        t_in = torch.as_tensor(t, device=self._execution_device).reshape(1).expand(model_in.shape[0])
        out = self.transformer(model_in.to(self.transformer.dtype), timestep=t_in, class_labels=labels,
                               output_head_usage=run.output_head_usage)
        pred = out.sample.float()  # (B or 2B, C or 2C, H, W)
        if guided:
            cond, uncond = pred.chunk(2)
            eps = uncond[:, :num_guided] + self._guidance_scale * (cond[:, :num_guided] - uncond[:, :num_guided])
            pred = torch.cat([eps, cond[:, num_guided:]], dim=1)  # (B, C or 2C, H, W)
        if not run.use_variance:
            pred = pred[:, :channels]
        x = self.scheduler.step(pred, t, x, **run.step_kwargs).prev_sample
        return x, [u.float() for u in out.head_usage] if run.output_head_usage else None

    def _output_images(self, x: torch.Tensor, output_type: str):
        """Final latents -> ``output_type`` (``"latent"``: ``x`` itself)."""
        if output_type == "latent":
            return x
        images = (self.decode(x).float() / 2 + 0.5).clamp(0, 1)  # (B, C, H, W) in [0, 1]
        if output_type == "pt":
            return images
        images = images.cpu().permute(0, 2, 3, 1).numpy()  # (B, H, W, C)
        return self.numpy_to_pil(images) if output_type == "pil" else images
