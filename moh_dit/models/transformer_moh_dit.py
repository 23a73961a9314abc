"""MoH-DiT: a class-conditional Diffusion Transformer with Mixture-of-Head attention.

Reading order: ``MoHDiTBlock``, ``MoHDiTTransformer2DModel``. The attention itself (routing,
gates, the dense-masked computation, ``MoHAttention``) is in ``attention.py``, the per-layer
head layout in ``layout.py``; ``MoHAttention``, ``MoHAttnProcessor``, ``MoHRouting``,
``SparseInferencePolicy``, ``min_top_k`` and ``top_k_for_ratio`` are re-exported here. Shared
pieces come from diffusers: ``PatchEmbed``, ``AdaLayerNormZero``, ``FeedForward``,
``Timesteps`` / ``TimestepEmbedding`` / ``LabelEmbedding``, ``AttentionMixin``
(``attn_processors`` / ``set_attn_processor``) and ``PeftAdapterMixin`` (LoRA: ``add_adapter``,
``load_lora_adapter``, ...; needs the optional ``peft``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.attention import AttentionMixin, FeedForward
from diffusers.models.embeddings import CombinedTimestepLabelEmbeddings, PatchEmbed, Timesteps
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import AdaLayerNormZero
from diffusers.utils import BaseOutput
from torch import nn

from .attention import MoHAttention, MoHAttnProcessor, MoHRouting
from ..errors import DamagedFile
from .config_checks import check_transformer_config
from .fast_paths import SparseInferencePolicy
from .layout import HeadLayout, min_top_k, top_k_for_ratio
from .presets import get_preset

__all__ = [
    "MoHRouting",
    "SparseInferencePolicy",
    "min_top_k",
    "MoHAttnProcessor",
    "MoHAttention",
    "MoHDiTBlock",
    "MoHDiTTransformer2DModel",
    "MoHDiTTransformer2DModelOutput",
    "top_k_for_ratio",
]


# --------------------------------------------------------------------------------------
# Block
# --------------------------------------------------------------------------------------


class MoHDiTBlock(nn.Module):
    """DiT block with adaLN-Zero conditioning (Peebles & Xie 2023, Fig. 3) and MoH attention."""

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        num_shared_heads: int | None,
        top_k: int | None,
        mlp_ratio: float = 4.0,
        gate_mode: str = "release",
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        # AdaLayerNormZero without its own embedder: the model computes the timestep+label
        # embedding once and passes it in (diffusers' DiT keeps a copy in every block).
        self.norm1 = AdaLayerNormZero(dim, num_embeddings=None)
        self.norm1.norm.eps = norm_eps
        self.attn1 = MoHAttention(dim, heads, head_dim, num_shared_heads, top_k, gate_mode)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=norm_eps)
        self.ff = FeedForward(dim, mult=mlp_ratio, activation_fn="gelu-approximate")

    def forward(self, x: torch.Tensor, emb: torch.Tensor, need_stats: bool = False):
        """(B, N, D) -> (B, N, D), and with ``need_stats`` the attention's load-balance loss
        (scalar, None without routed heads) and head usage ((h,), None for a dense layer)."""
        norm_x, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, emb=emb)  # (B, N, D), 4 x (B, D)
        attn_out = self.attn1(norm_x)  # (B, N, D)
        routing, self.attn1.routing = self.attn1.routing, None  # read and cleared: no tensors kept
        x = x + gate_msa.unsqueeze(1) * attn_out  # (B, N, D)
        norm_x = self.norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]  # (B, N, D)
        x = x + gate_mlp.unsqueeze(1) * self.ff(norm_x)  # (B, N, D)
        if routing is None or not need_stats:
            return x, None, None
        return x, routing.load_balance_loss, routing.head_usage


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


class DiTTimestepLabelEmbedding(CombinedTimestepLabelEmbeddings):
    """Timestep + class embedding of the original DiT, shared by all blocks.

    diffusers' version uses ``downscale_freq_shift=1`` (frequencies ``exp(-ln(1e4) i/127)``);
    DiT uses ``i/128``, i.e. shift 0. The null-class row (index ``num_classes``) always
    exists, also when training without label dropout, because guidance needs it.
    """

    def __init__(self, num_classes: int, embedding_dim: int, class_dropout_prob: float):
        super().__init__(num_classes, embedding_dim, class_dropout_prob=1.0)
        self.time_proj = Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.class_embedder.dropout_prob = class_dropout_prob

    def forward(self, timestep: torch.Tensor, class_labels: torch.Tensor, hidden_dtype=None,
                force_drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, D) conditioning. ``force_drop_ids`` (B,): where true (or 1), the label becomes the
        null class, and nothing is drawn at random; None: diffusers' behaviour (in training,
        each label dropped with probability ``class_dropout_prob``, drawn here)."""
        timesteps_emb = self.timestep_embedder(self.time_proj(timestep).to(dtype=hidden_dtype))  # (B, D)
        if force_drop_ids is None:
            return timesteps_emb + self.class_embedder(class_labels)
        embedder = self.class_embedder
        labels = torch.where(force_drop_ids.to(class_labels.device) != 0, embedder.num_classes, class_labels)
        return timesteps_emb + embedder.embedding_table(labels)  # (B, D)


@dataclass
class MoHDiTTransformer2DModelOutput(BaseOutput):
    """Output of ``MoHDiTTransformer2DModel``.

    Args:
        sample: (B, C_out, H, W) prediction; with learned sigma the first C channels are eps
            and the last C the variance interpolation values.
        load_balance_loss: scalar mean of the per-layer load-balance losses over layers with
            routed heads (zero if there are none); None unless requested or training.
        head_usage: one (h_l,) tensor per layer, the fraction of tokens that used each head
            (shared heads 1.0); None unless requested.
    """

    sample: torch.Tensor
    load_balance_loss: torch.Tensor | None = None
    head_usage: list[torch.Tensor] | None = None


class MoHDiTTransformer2DModel(ModelMixin, ConfigMixin, AttentionMixin, PeftAdapterMixin):
    """Class-conditional DiT with Mixture-of-Head attention (or dense attention).

    diffusers' LoRA API works on it (``add_adapter``, ``set_adapters``, ``disable_adapters``,
    ``save_lora_adapter``; ``load_lora_adapter(folder, prefix=None, use_safetensors=True)``
    reads what ``save_lora_adapter`` wrote); adapters may target the routers too (docs/lora.md).

    Args:
        sample_size: input height and width (latent pixels).
        patch_size: patch side; tokens = (sample_size / patch_size) ** 2.
        in_channels: input channels (4 for SD-VAE latents, 3 in pixel space).
        out_channels: output channels; defaults to ``2 * in_channels`` with learned sigma.
        learn_sigma: predict the variance interpolation values too (DiT/IDDPM).
        hidden_size: transformer width D.
        num_layers: number of blocks.
        num_attention_heads: heads per layer (int for all layers, or a list).
        attention_head_dim: channels per head; a layer's inner width is heads * head_dim.
        num_shared_heads: always-active heads per layer (int or list); None for dense DiT.
        top_k: routed heads each token selects, per layer (int or list); None for dense DiT.
        mlp_ratio: MLP hidden width / D.
        num_classes: number of classes; class id ``num_classes`` is the null class (CFG).
        class_dropout_prob: label dropout in training (drawn once per sample).
        gate_mode: ``"release"`` (the authors' checkpoint gates) or ``"paper"`` (Eq. 5-6).
        norm_eps: LayerNorm epsilon (DiT: 1e-6).
        class_names: optional names of the classes, index = class id (saved with the model).
        label_embedding_init_std: std of the label table's normal initialisation. DiT's 0.02
            (the default) suits the paper's long runs; in a run of a few thousand steps the
            table stays so small that the model learns to ignore its labels, and 1.0 (the
            scale of diffusers' ``DiTTransformer2DModel``, ``nn.Embedding``'s default) makes
            conditioning take hold (the CPU demo uses it). Only initialisation: no effect on
            loaded weights.
    """

    _supports_gradient_checkpointing = True
    _no_split_modules = ["MoHDiTBlock"]

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        out_channels: int | None = None,
        learn_sigma: bool = True,
        hidden_size: int = 1152,
        num_layers: int = 28,
        num_attention_heads: int | list[int] = 16,
        attention_head_dim: int = 72,
        num_shared_heads: int | list[int] | None = None,
        top_k: int | list[int] | None = None,
        mlp_ratio: float = 4.0,
        num_classes: int = 1000,
        class_dropout_prob: float = 0.1,
        gate_mode: str = "release",
        norm_eps: float = 1e-6,
        class_names: list[str] | None = None,
        label_embedding_init_std: float = 0.02,
    ):
        super().__init__()
        if not (isinstance(label_embedding_init_std, (int, float)) and label_embedding_init_std >= 0):
            raise ValueError(f"label_embedding_init_std must be a number >= 0, got {label_embedding_init_std!r}.")
        check_transformer_config(dict(
            sample_size=sample_size, patch_size=patch_size, in_channels=in_channels, out_channels=out_channels,
            learn_sigma=learn_sigma, hidden_size=hidden_size, num_layers=num_layers,
            num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim,
            num_shared_heads=num_shared_heads, top_k=top_k, mlp_ratio=mlp_ratio, num_classes=num_classes,
            class_dropout_prob=class_dropout_prob, norm_eps=norm_eps))
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"class_names has {len(class_names)} entries but num_classes={num_classes}.")
        self.layout = HeadLayout.parse(num_layers, num_attention_heads, num_shared_heads, top_k)
        heads, shared, k = self.layout.heads, self.layout.shared, self.layout.top_k
        self.out_channels = out_channels if out_channels is not None else in_channels * (2 if learn_sigma else 1)
        self.gradient_checkpointing = False

        self.pos_embed = PatchEmbed(
            height=sample_size, width=sample_size, patch_size=patch_size, in_channels=in_channels, embed_dim=hidden_size
        )
        self.time_class_embed = DiTTimestepLabelEmbedding(num_classes, hidden_size, class_dropout_prob)
        self.transformer_blocks = nn.ModuleList(
            [
                MoHDiTBlock(
                    hidden_size, heads[i], attention_head_dim,
                    None if shared is None else shared[i], None if k is None else k[i],
                    mlp_ratio, gate_mode, norm_eps,
                )
                for i in range(num_layers)
            ]
        )
        for i, block in enumerate(self.transformer_blocks):
            block.attn1.layer_name = f"transformer_blocks.{i}.attn1"  # named in its errors
        self.norm_out = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=norm_eps)
        self.proj_out_1 = nn.Linear(hidden_size, 2 * hidden_size)
        self.proj_out_2 = nn.Linear(hidden_size, patch_size * patch_size * self.out_channels)
        self.initialize_weights()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "MoHDiTTransformer2DModel":
        """Build a randomly initialised model from a preset, e.g. ``from_preset("MoH-DiT-B/2-75")``."""
        return cls(**get_preset(name, **overrides))

    @classmethod
    def load_config(cls, pretrained_model_name_or_path, *args: Any, **kwargs: Any):
        """``ConfigMixin.load_config``; a pipeline folder (a training run's ``final/``) given
        without ``subfolder`` is refused in one line that says which subfolder holds the model."""
        folder = Path(str(pretrained_model_name_or_path))
        pipeline = (folder / "model_index.json").is_file() and not (folder / "config.json").is_file()
        if pipeline and not kwargs.get("subfolder"):
            raise OSError(f"{folder} is a pipeline folder, not a model folder: pass subfolder=\"transformer\" to load "
                          "its transformer.")
        return super().load_config(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args: Any, **kwargs: Any):
        """``ModelMixin.from_pretrained``; weights whose shapes do not fit the folder's
        ``config.json`` (an edited config, or files of two models mixed) are refused naming the
        folder, where diffusers' message names neither."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except ValueError as error:
            if "expected shape" not in str(error):
                raise
            folder = Path(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
            detail = str(error).partition(" because ")[2].partition(". ")[0] or str(error)
            raise DamagedFile(f"{folder}: the weights do not fit its config.json ({detail}); the config and the "
                              "weights come from different models: save the model again, or restore its config.json.",
                              parameters="pretrained_model_name_or_path") from None

    def initialize_weights(self) -> None:
        """DiT's initialisation: xavier-uniform linears with zero bias, patch embedding as a
        linear, N(0, 0.02) label table (``label_embedding_init_std``) and timestep MLP, zero adaLN modulation and output
        layer (so every block starts as the identity)."""

        def basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(basic_init)
        w = self.pos_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.pos_embed.proj.bias)
        nn.init.normal_(self.time_class_embed.class_embedder.embedding_table.weight,
                        std=self.config.label_embedding_init_std)
        nn.init.normal_(self.time_class_embed.timestep_embedder.linear_1.weight, std=0.02)
        nn.init.normal_(self.time_class_embed.timestep_embedder.linear_2.weight, std=0.02)
        for block in self.transformer_blocks:
            nn.init.zeros_(block.norm1.linear.weight)
            nn.init.zeros_(block.norm1.linear.bias)
        for layer in (self.proj_out_1, self.proj_out_2):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    # ---------------------------------------------------------------- head activation
    @property
    def layer_heads(self) -> list[int]:
        return list(self.layout.heads)

    @property
    def layer_shared(self) -> list[int] | None:
        """Shared heads per layer; None for a dense DiT."""
        return None if self.layout.shared is None else list(self.layout.shared)

    @property
    def trained_top_k(self) -> list[int] | None:
        """The routed top-K per layer the model was built with; None for a dense DiT."""
        return None if self.layout.top_k is None else list(self.layout.top_k)

    @property
    def is_moh(self) -> bool:
        return self.layout.is_moh

    @property
    def top_k_per_layer(self) -> list[int]:
        """The routed top-K each layer uses now (0 for dense or all-shared layers)."""
        return [block.attn1.top_k for block in self.transformer_blocks]

    @property
    def head_activation_ratio(self) -> float:
        """Current head-weighted activation ``sum (hs + K) / sum h`` (1.0 for a dense model)."""
        return self.layout.activation_ratio(self.top_k_per_layer)

    @property
    def trained_head_activation_ratio(self) -> float:
        return self.layout.activation_ratio()

    @property
    def head_activation_range(self) -> tuple[float, float]:
        """(lowest, highest) head-weighted ratio that ``set_head_activation_ratio`` accepts."""
        return self.layout.reachable_range()

    def set_head_activation_ratio(
        self, ratio: float | None, overrides: dict[int, int] | None = None
    ) -> float:
        """Set every layer's routed top-K to realise the head-weighted activation ``ratio``.

        ``None`` restores the trained top-K. The allocation rule is ``top_k_for_ratio``'s:
        the closest reachable number of active heads, shared heads always on, routed heads
        added or removed in proportion to each layer's room, the trained layout exactly at
        the trained ratio. ``overrides`` (layer index -> top-K) are applied afterwards.
        Raises ValueError outside the reachable range. Returns the realised ratio.
        """
        if not self.is_moh:
            if ratio is not None and abs(ratio - 1.0) > 1e-9:
                raise ValueError(f"This is a dense DiT: its head activation ratio is always 1.0, not {ratio}.")
            if overrides:
                raise ValueError("This is a dense DiT: it has no routed heads to override.")
            return 1.0
        if ratio is None:
            new_k = list(self.trained_top_k)
        else:
            new_k = self.layout.top_k_for_ratio(float(ratio))
        for layer, k in (overrides or {}).items():
            if not 0 <= layer < len(new_k):
                raise ValueError(f"Layer index {layer} is out of range for a {len(new_k)}-layer model.")
            heads, shared = self.layout.heads[layer], self.layout.shared[layer]
            routed, k_min = heads - shared, min_top_k(heads, shared)
            if not k_min <= k <= routed:
                raise ValueError(f"Layer {layer}: top_k={k} must be in [{k_min}, {routed}] for this layer.")
            new_k[layer] = int(k)
        for block, k in zip(self.transformer_blocks, new_k):
            block.attn1.top_k = k
        return self.head_activation_ratio

    def set_sparse_inference(self, enabled: bool | None, policy: SparseInferencePolicy | None = None) -> None:
        """Choose the attention path used in eval mode for every MoH layer.

        ``True`` forces the head-sparse path (``MoHSparseAttnProcessor``: unselected routed
        heads are skipped; same output as the dense-masked path to float rounding, and
        same gradients), ``False`` forces the dense-masked path, ``None`` (default) picks
        head-sparse automatically when autograd is off, the model is not being compiled, the
        input is on the CPU (on a GPU dense-masked is faster) and a layer is sparse and large
        enough for skipping to pay (at most half its heads active, tokens x inner width >=
        256 x 768; smaller work is faster dense-masked).
        Either way a layer whose tokens select more than the sparse processor's
        ``dense_above`` of its routed heads, a layer with a processor other than
        ``MoHAttnProcessor`` or with an adapter (LoRA) on a projection, and any call inside an
        autocast region, runs its processor instead (dense-masked by default;
        ``fast_paths.choose_path`` decides, per layer and call).
        Training mode always uses the dense-masked path. A dense DiT ignores the setting.

        ``policy`` (optional) sets automatic mode's thresholds on every layer (a
        ``SparseInferencePolicy``: largest active fraction of heads, smallest tokens x inner
        width, devices); ``None`` leaves them as they are (by default the values above).
        """
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"set_sparse_inference takes True, False or None; got {enabled!r}.")
        if policy is not None and not isinstance(policy, SparseInferencePolicy):
            raise ValueError(f"policy must be a SparseInferencePolicy or None; got {policy!r}.")
        for block in self.transformer_blocks:
            block.attn1.sparse_inference = enabled
            if policy is not None:
                block.attn1.sparse_policy = policy

    # ---------------------------------------------------------------- forward
    def _check_inputs(self, hidden_states: torch.Tensor, timestep, class_labels) -> torch.Tensor:
        if hidden_states.ndim != 4:
            raise ValueError(f"hidden_states must be (batch, channels, height, width); got shape {tuple(hidden_states.shape)}.")
        batch, channels, height, width = hidden_states.shape
        p = self.config.patch_size
        if channels != self.config.in_channels:
            raise ValueError(f"hidden_states has {channels} channels but the model expects in_channels={self.config.in_channels}.")
        if height != width:
            raise ValueError(f"MoH-DiT takes square inputs; got {height}x{width}. Crop or pad to a square first.")
        if height % p:
            raise ValueError(f"Spatial size {height} is not divisible by patch_size={p}; use a multiple of {p}.")
        if class_labels is None:
            raise ValueError(f"class_labels is required: class ids in [0, {self.config.num_classes}] ({self.config.num_classes} = unconditional).")
        if class_labels.shape != (batch,):
            raise ValueError(f"class_labels must have shape ({batch},); got {tuple(class_labels.shape)}.")
        if class_labels.dtype.is_floating_point or class_labels.dtype == torch.bool:
            raise ValueError(f"class_labels must be integer class ids; got dtype {class_labels.dtype}.")
        # The range check reads the labels on the host. On a GPU that is a sync per forward,
        # so it runs only for labels on the CPU: the pipeline and the training loop check
        # the labels on the host before moving them, and a bad id on a GPU trips the
        # embedding's device-side assert.
        if class_labels.device.type == "cpu" and not torch.compiler.is_compiling():
            lo, hi = int(class_labels.min()), int(class_labels.max())
            if lo < 0 or hi > self.config.num_classes:
                raise ValueError(
                    f"class id out of range: got values in [{lo}, {hi}], allowed [0, {self.config.num_classes}] "
                    f"({self.config.num_classes} is the null class used for guidance)."
                )
        if not torch.is_tensor(timestep):
            timestep = torch.tensor([timestep], device=hidden_states.device)
        if timestep.ndim == 0:
            timestep = timestep[None]
        if timestep.ndim != 1 or timestep.shape[0] not in (1, batch):
            raise ValueError(f"timestep must be a scalar or have shape ({batch},); got shape {tuple(timestep.shape)}.")
        return timestep.to(hidden_states.device).expand(batch)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor | int | float,
        class_labels: torch.LongTensor,
        return_dict: bool = True,
        output_load_balance_loss: bool | None = None,
        output_head_usage: bool = False,
        force_drop_ids: torch.Tensor | None = None,
    ) -> MoHDiTTransformer2DModelOutput | tuple:
        """Predict eps (and the variance values) for noisy inputs.

        Args:
            hidden_states: (B, C, H, W) noisy latents or images.
            timestep: (B,) or scalar diffusion step(s).
            class_labels: (B,) class ids; ``num_classes`` is the null class.
            return_dict: return a ``MoHDiTTransformer2DModelOutput`` (else a tuple
                ``(sample, load_balance_loss, head_usage)``).
            output_load_balance_loss: compute the load-balance loss; default: in training.
            output_head_usage: return per-layer head usage fractions.
            force_drop_ids: (B,) label dropout decided by the caller: where true (or 1) the
                label becomes the null class, in training and in eval, and the model draws
                nothing. None (default): in training each label is dropped with probability
                ``class_dropout_prob``, drawn inside the forward (diffusers' behaviour; a
                compiled forward draws it from the compiler's generator, not torch's, so the
                trainer draws the mask itself and passes it).
        """
        timestep = self._check_inputs(hidden_states, timestep, class_labels)
        if force_drop_ids is not None and tuple(force_drop_ids.shape) != tuple(class_labels.shape):
            raise ValueError(f"force_drop_ids must have the shape of class_labels {tuple(class_labels.shape)}; got "
                             f"{tuple(force_drop_ids.shape)}.")
        want_lb = self.training if output_load_balance_loss is None else output_load_balance_loss
        need_stats = want_lb or output_head_usage
        size = hidden_states.shape[-1] // self.config.patch_size

        # PatchEmbed returns a transposed view (the D axis has stride T). Without the copy the
        # residual stream keeps that layout through every block (x comes first in each
        # residual add) and all its elementwise ops run strided; one copy here is far cheaper.
        x = self.pos_embed(hidden_states).contiguous()  # (B, T, D), T = size * size
        c = self.time_class_embed(timestep, class_labels, hidden_dtype=x.dtype, force_drop_ids=force_drop_ids)  # (B, D)
        lb_losses, usage = [], []
        for block in self.transformer_blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                x, lb, used = self._gradient_checkpointing_func(block, x, c, need_stats)
            else:
                x, lb, used = block(x, c, need_stats)  # (B, T, D)
            if lb is not None:
                lb_losses.append(lb)
            if output_head_usage:
                usage.append(used if used is not None else x.new_ones(block.attn1.heads, dtype=torch.float32))

        shift, scale = self.proj_out_1(F.silu(c)).chunk(2, dim=1)  # 2 x (B, D)
        x = self.norm_out(x) * (1 + scale[:, None]) + shift[:, None]  # (B, T, D)
        x = self.proj_out_2(x)  # (B, T, p*p*C_out)

        p, c_out = self.config.patch_size, self.out_channels
        x = x.reshape(-1, size, size, p, p, c_out)  # (B, h, w, p, p, C_out)
        x = torch.einsum("nhwpqc->nchpwq", x)
        sample = x.reshape(-1, c_out, size * p, size * p)  # (B, C_out, H, W)

        lb_loss = None
        if want_lb:
            lb_loss = torch.stack(lb_losses).mean() if lb_losses else sample.new_zeros((), dtype=torch.float32)
        head_usage = usage if output_head_usage else None
        if not return_dict:
            return sample, lb_loss, head_usage
        return MoHDiTTransformer2DModelOutput(sample=sample, load_balance_loss=lb_loss, head_usage=head_usage)
