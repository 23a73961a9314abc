"""MoH-DiT: a class-conditional Diffusion Transformer with Mixture-of-Head attention.

Reading order: the head-sparse policy, attention processor, ``MoHAttention``,
``MoHDiTBlock``, ``MoHDiTTransformer2DModel``. The routing result (``MoHRouting``) and the
attention computations (dense-masked and head-sparse) live in ``sparse_attention.py``, the
gate arithmetic and the fused QKV + router GEMM in ``moh_routing.py``, the top-K-for-ratio
rule in ``head_layout.py``; this module imports from them, they never import it back, and
``MoHRouting``, ``min_top_k`` and ``top_k_for_ratio`` are re-exported here. Shared pieces come from diffusers: ``Attention`` (projections
and the processor mechanism), ``PatchEmbed``, ``AdaLayerNormZero``, ``FeedForward``,
``Timesteps`` / ``TimestepEmbedding`` / ``LabelEmbedding``.

Gate math follows the authors' MoH-DiT release (docs/design.md, section 1), which differs
from the paper's Eq. 5-6 by constant factors; ``gate_mode="paper"`` gives the equations as
printed. Heads ``0..hs-1`` of each layer are shared (always on), heads ``hs..h-1`` routed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import CombinedTimestepLabelEmbeddings, PatchEmbed, Timesteps
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import AdaLayerNormZero
from diffusers.utils import BaseOutput
from torch import nn

from .presets import get_preset, resolve_layer_layout
from .sparse_attention import STRATEGIES as SPARSE_STRATEGIES
from .head_layout import min_top_k, top_k_for_ratio
from .moh_routing import ROUTERS, fusable, fused_dense_masked_attention, route_from_logits
from .sparse_attention import MoHRouting, MoHSparseAttnProcessor, dense_masked_attention, skips_at_density

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

GATE_MODES = ("release", "paper")


# --------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseInferencePolicy:
    """When automatic mode (``sparse_inference=None``) takes the head-sparse path: only
    where skipping heads pays for gathering the selected tokens.

    Args:
        max_active: largest fraction ``(hs + K) / h`` of a layer's heads that may be active.
        min_work: smallest ``tokens * inner_dim`` of a call. Below these two, gathering the
            selected tokens costs more than the skipped heads save
            (``benchmarks/benchmark_attention.py``: on 2 CPU cores a DiT-B layer at 256 tokens
            took 0.88x dense time with half its heads active, 1.03x with three quarters).
        devices: device types the input may be on. On an H200 (torch 2.11, bf16) every
            head-sparse strategy was slower than dense-masked at every measured size: the
            GEMMs there are so fast that launches, host syncs and gathers dominate.
    """

    max_active: float = 0.5
    min_work: int = 256 * 768
    devices: tuple[str, ...] = ("cpu",)

    def __post_init__(self):
        if not 0.0 <= self.max_active <= 1.0:
            raise ValueError(f"max_active={self.max_active} must be in [0, 1].")
        if self.min_work < 0:
            raise ValueError(f"min_work={self.min_work} must be >= 0.")
        if isinstance(self.devices, str) or not all(isinstance(d, str) for d in self.devices):
            raise ValueError(f"devices={self.devices!r} must be a tuple of device types such as ('cpu',).")
        object.__setattr__(self, "devices", tuple(self.devices))


class MoHAttnProcessor:
    """Dense-masked MoH attention (``sparse_attention.dense_masked_attention``): every head
    is computed (SDPA), then each head's output is multiplied by its gate before the output
    projection (zero for unselected routed heads).

    This is the release's computation and the training path (routers get gradients through
    the gates). A dense layer (``routing is None``) is plain multi-head attention.
    """

    def __call__(self, attn: MoHAttention, hidden_states: torch.Tensor, routing: MoHRouting | None = None):
        return dense_masked_attention(attn, hidden_states, routing)


class MoHAttention(Attention):
    """diffusers ``Attention`` with Mixture-of-Head routers.

    Router parameters live on this module, so they are saved with the model:

    =================  ===========  ================  ===================================
    attribute          release      shape             exists when
    =================  ===========  ================  ===================================
    ``router_routed``  ``wg``       (h - hs, D)       there are routed heads (h > hs)
    ``router_mix``     ``wg_0``     (2, D)            routed heads and hs > 0
    ``router_shared``  ``wg_1``     (hs, D)           hs > 1
    =================  ===========  ================  ===================================

    With ``num_shared_heads=None`` the layer is a plain dense attention (DiT baseline).
    ``inner_dim = heads * dim_head`` may differ from ``query_dim``.

    Head-sparse inference: ``sparse_inference`` chooses between ``processor`` (dense-masked,
    the training path) and ``sparse_processor`` (``MoHSparseAttnProcessor``, which skips
    the routed heads a token did not select; same result to float rounding): ``None``
    (default) = automatic, in eval mode with autograd off, on the CPU, for layers sparse
    and large enough for skipping to pay (``sparse_policy``); ``True`` = whenever in eval
    mode; ``False`` = never. ``uses_sparse_processor`` decides, per call, with every
    condition. Assign a configured ``MoHSparseAttnProcessor`` to ``sparse_processor`` to
    change how it skips (strategy, ``dense_above``).
    """

    def __init__(
        self,
        query_dim: int,
        heads: int,
        dim_head: int,
        num_shared_heads: int | None = None,
        top_k: int | None = None,
        gate_mode: str = "release",
        bias: bool = True,
        processor: Any | None = None,
    ):
        super().__init__(
            query_dim=query_dim, heads=heads, dim_head=dim_head, bias=bias, out_bias=True,
            processor=processor if processor is not None else MoHAttnProcessor(),
        )
        if gate_mode not in GATE_MODES:
            raise ValueError(f"gate_mode={gate_mode!r}; choose one of {GATE_MODES}.")
        self.gate_mode = gate_mode
        self.is_moh = num_shared_heads is not None
        self.num_shared_heads = num_shared_heads if self.is_moh else heads
        self.num_routed_heads = heads - self.num_shared_heads
        self.trained_top_k = top_k if self.is_moh else 0
        self.top_k = self.trained_top_k
        self.router_routed = nn.Linear(query_dim, self.num_routed_heads, bias=False) if self.num_routed_heads else None
        self.router_mix = (
            nn.Linear(query_dim, 2, bias=False) if self.num_routed_heads and self.num_shared_heads > 0 else None
        )
        self.router_shared = nn.Linear(query_dim, self.num_shared_heads, bias=False) if self.is_moh and self.num_shared_heads > 1 else None
        self.sparse_processor = MoHSparseAttnProcessor()
        self.sparse_inference: bool | None = None
        self.sparse_policy = SparseInferencePolicy()
        # Dense-masked path: QKV and routers as one GEMM (same weights, same keys). None: fused on
        # CUDA, where one launch instead of four is what pays; elsewhere the separate linears,
        # which keep CPU results (the demo's documented numbers) bit-identical. True/False force it.
        self.fused_projections: bool | None = None

    def route(self, x: torch.Tensor, need_stats: bool = False) -> MoHRouting | None:
        """Gates of every head for every token of ``x`` (B, N, D); None for a dense layer.

        Release gates (docs/design.md, section 1): routed ``K * p_j / sum_topK p`` with
        ``p = softmax(W_r x)``; shared ``hs * softmax(W_s x)``; with both kinds, shared gates
        times ``a_0`` and routed times ``a_1`` where ``a = 2 * softmax(W_h x)``. A single
        shared head gets a constant gate of 1 (the release crashes there). ``paper`` mode
        drops the K, hs and 2 factors and the top-K renormalisation (paper Eq. 5-6).
        Router softmaxes run in float32 whatever the compute dtype (``moh_routing.route_from_logits``).
        """
        if not self.is_moh:
            return None
        logits = {name: getattr(self, name)(x) for name in ROUTERS if getattr(self, name) is not None}
        return route_from_logits(self, x, logits, need_stats)

    def uses_sparse_processor(self, tokens: int | None = None, device: torch.device | None = None) -> bool:
        """Whether a forward call on ``tokens`` tokens on ``device`` skips heads, i.e. runs
        ``sparse_processor`` (else ``processor``). The one place this is decided.

        Never in training mode, with ``sparse_inference=False`` or without routed heads.
        Never either when the routed density is above the sparse processor's
        ``dense_above`` or every routed head is selected (``skips_at_density``; a processor
        without ``dense_above`` skips at any density), or inside an autocast region on
        ``device`` (the projections would come out in another dtype than the input, and the
        sparse strategies' out= / in-place kernels would mix them). Then always with
        ``sparse_inference=True``. In automatic mode also only when autograd is off, the
        default processor is in place, the model is not being compiled, and ``sparse_policy``
        allows it: at most ``max_active`` of the heads active, ``tokens * inner_dim`` of at
        least ``min_work`` and the input on one of ``devices``. ``device=None`` leaves out
        the conditions on the device (autocast and ``devices``).
        """
        if self.training or self.sparse_inference is False or not self.num_routed_heads:
            return False
        dense_above = getattr(self.sparse_processor, "dense_above", 1.0)
        if not skips_at_density(self.top_k, self.num_routed_heads, dense_above):
            return False
        if device is not None and torch.is_autocast_enabled(device.type):
            return False
        if self.sparse_inference:
            return True
        policy = self.sparse_policy
        active = (self.num_shared_heads + self.top_k) / self.heads
        return (
            not torch.is_grad_enabled()
            and type(self.processor) is MoHAttnProcessor
            and not torch.compiler.is_compiling()
            and active <= policy.max_active
            and (tokens or 0) * self.inner_dim >= policy.min_work
            and (device is None or device.type in policy.devices)
        )

    def forward(self, hidden_states: torch.Tensor, need_stats: bool = False) -> tuple[torch.Tensor, MoHRouting | None]:
        sparse = self.uses_sparse_processor(hidden_states.shape[1], hidden_states.device)
        fused = hidden_states.is_cuda if self.fused_projections is None else self.fused_projections
        if not sparse and fused and type(self.processor) is MoHAttnProcessor and fusable(self):
            return fused_dense_masked_attention(self, hidden_states, need_stats)  # one GEMM: QKV and routers
        routing = self.route(hidden_states, need_stats)
        processor = self.sparse_processor if sparse else self.processor
        return processor(self, hidden_states, routing=routing), routing


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
        norm_x, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, emb=emb)  # (B, N, D), 4 x (B, D)
        attn_out, routing = self.attn1(norm_x, need_stats)  # (B, N, D)
        x = x + gate_msa.unsqueeze(1) * attn_out  # (B, N, D)
        norm_x = self.norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]  # (B, N, D)
        x = x + gate_mlp.unsqueeze(1) * self.ff(norm_x)  # (B, N, D)
        if routing is None:
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


class MoHDiTTransformer2DModel(ModelMixin, ConfigMixin):
    """Class-conditional DiT with Mixture-of-Head attention (or dense attention).

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
        if sample_size % patch_size:
            raise ValueError(f"sample_size={sample_size} is not divisible by patch_size={patch_size}.")
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"class_names has {len(class_names)} entries but num_classes={num_classes}.")
        heads, shared, k = resolve_layer_layout(num_layers, num_attention_heads, num_shared_heads, top_k)
        self.layer_heads, self.layer_shared, self.trained_top_k = heads, shared, k
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
        self.norm_out = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=norm_eps)
        self.proj_out_1 = nn.Linear(hidden_size, 2 * hidden_size)
        self.proj_out_2 = nn.Linear(hidden_size, patch_size * patch_size * self.out_channels)
        self.initialize_weights()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "MoHDiTTransformer2DModel":
        """Build a randomly initialised model from a preset, e.g. ``from_preset("MoH-DiT-B/2-75")``."""
        return cls(**get_preset(name, **overrides))

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
    def is_moh(self) -> bool:
        return self.layer_shared is not None

    @property
    def top_k_per_layer(self) -> list[int]:
        """The routed top-K each layer uses now (0 for dense or all-shared layers)."""
        return [block.attn1.top_k for block in self.transformer_blocks]

    @property
    def head_activation_ratio(self) -> float:
        """Current head-weighted activation ``sum (hs + K) / sum h`` (1.0 for a dense model)."""
        if not self.is_moh:
            return 1.0
        return sum(s + k for s, k in zip(self.layer_shared, self.top_k_per_layer)) / sum(self.layer_heads)

    @property
    def trained_head_activation_ratio(self) -> float:
        if not self.is_moh:
            return 1.0
        return sum(s + k for s, k in zip(self.layer_shared, self.trained_top_k)) / sum(self.layer_heads)

    @property
    def head_activation_range(self) -> tuple[float, float]:
        """(lowest, highest) head-weighted ratio that ``set_head_activation_ratio`` accepts."""
        if not self.is_moh:
            return 1.0, 1.0
        lowest = sum(s + min_top_k(h, s) for h, s in zip(self.layer_heads, self.layer_shared))
        return lowest / sum(self.layer_heads), 1.0

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
            new_k = top_k_for_ratio(self.layer_heads, self.layer_shared, self.trained_top_k, float(ratio))
        for layer, k in (overrides or {}).items():
            if not 0 <= layer < len(new_k):
                raise ValueError(f"Layer index {layer} is out of range for a {len(new_k)}-layer model.")
            routed = self.layer_heads[layer] - self.layer_shared[layer]
            k_min = min_top_k(self.layer_heads[layer], self.layer_shared[layer])
            if not k_min <= k <= routed:
                raise ValueError(f"Layer {layer}: top_k={k} must be in [{k_min}, {routed}] for this layer.")
            new_k[layer] = int(k)
        for block, k in zip(self.transformer_blocks, new_k):
            block.attn1.top_k = k
        return self.head_activation_ratio

    def set_sparse_inference(
        self, enabled: bool | None, strategy: str | None = None, policy: SparseInferencePolicy | None = None
    ) -> None:
        """Choose the attention path used in eval mode for every MoH layer.

        ``True`` forces the head-sparse path (``MoHSparseAttnProcessor``: unselected routed
        heads are skipped; same output as the dense-masked path to float rounding, and
        same gradients), ``False`` forces the dense-masked path, ``None`` (default) picks
        head-sparse automatically when autograd is off, the model is not being compiled, the
        input is on the CPU (on a GPU dense-masked was faster everywhere measured) and a
        layer is sparse and large enough for skipping to pay (at most half its heads active,
        tokens x inner width >= 256 x 768; smaller work is faster dense-masked).
        Either way a layer whose tokens select more than the sparse processor's
        ``dense_above`` of its routed heads, and any call inside an autocast region, runs
        dense-masked (``MoHAttention.uses_sparse_processor`` decides, per layer and call).
        Training mode always uses the dense-masked path. A dense DiT ignores the setting.

        ``strategy`` (optional) sets how the head-sparse path works on every layer:
        ``"per_head"``, ``"batched"`` or ``"packed"`` (see ``MoHSparseAttnProcessor``), or
        ``"auto"`` to choose by device again (``per_head`` on CPU, ``batched`` on CUDA);
        ``None`` leaves it as it is.

        ``policy`` (optional) sets automatic mode's thresholds on every layer (a
        ``SparseInferencePolicy``: largest active fraction of heads, smallest tokens x inner
        width, devices); ``None`` leaves them as they are (by default the values above).
        """
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"set_sparse_inference takes True, False or None; got {enabled!r}.")
        if strategy is not None and strategy != "auto" and strategy not in SPARSE_STRATEGIES:
            raise ValueError(f"strategy={strategy!r}; choose one of {SPARSE_STRATEGIES}, 'auto' or None.")
        if policy is not None and not isinstance(policy, SparseInferencePolicy):
            raise ValueError(f"policy must be a SparseInferencePolicy or None; got {policy!r}.")
        for block in self.transformer_blocks:
            block.attn1.sparse_inference = enabled
            if strategy is not None:
                block.attn1.sparse_processor.strategy = None if strategy == "auto" else strategy
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
        """
        timestep = self._check_inputs(hidden_states, timestep, class_labels)
        want_lb = self.training if output_load_balance_loss is None else output_load_balance_loss
        need_stats = want_lb or output_head_usage
        size = hidden_states.shape[-1] // self.config.patch_size

        # PatchEmbed returns a transposed view (the D axis has stride T). Without the copy the
        # residual stream keeps that layout through every block (x comes first in each
        # residual add) and all its elementwise ops run strided: on an H200 (bf16, batch 32,
        # CUDA graph) the copy took a DiT-XL/2 forward from 25.9 to 19.9 ms (diffusers'
        # DiT-XL/2: 21.1 ms in both runs). No measurable effect on CPU.
        x = self.pos_embed(hidden_states).contiguous()  # (B, T, D), T = size * size
        c = self.time_class_embed(timestep, class_labels, hidden_dtype=x.dtype)  # (B, D)
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
