"""MoH-DiT: a class-conditional Diffusion Transformer with Mixture-of-Head attention.

Multi-head attention in summation form is ``out = sum_i H_i W_O^i``; MoH (Jin et al. 2025) gives
each token a gate per head, ``out_t = sum_i g_{t,i} H_{t,i} W_O^i``. Heads ``0..hs-1`` of a layer
are shared (always on), heads ``hs..h-1`` routed, of which each token keeps its top-K. The gates
are those of the authors' MoH-DiT release, which differ from the paper's Eq. 5-6 by constant
factors; ``gate_mode="paper"`` gives the equations as printed.

Reading order: the head layout (``HeadLayout``, ``top_k_for_ratio``), the routing
(``MoHRouting``), the dense-masked computation (``MoHAttnProcessor``), ``MoHAttention``, the
block and ``MoHDiTTransformer2DModel``. This file imports only torch, diffusers and the standard
library, so that an exported model folder carries it as it is.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.attention import AttentionMixin, FeedForward
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import CombinedTimestepLabelEmbeddings, PatchEmbed, Timesteps
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import AdaLayerNormZero
from diffusers.utils import BaseOutput, apply_lora_scale
from torch import nn

__all__ = ["HeadLayout", "top_k_for_ratio", "MoHRouting", "MoHAttnProcessor", "MoHAttention", "MoHDiTBlock",
           "MoHDiTTransformer2DModel", "MoHDiTTransformer2DModelOutput", "head_activation"]


# --------------------------------------------------------------------------------------
# Head layout
# --------------------------------------------------------------------------------------


def _min_top_k(heads: int, shared: int) -> int:
    """A layer without shared heads keeps one routed head, so that it still attends."""
    return 1 if shared == 0 and heads > shared else 0


def top_k_for_ratio(heads: Sequence[int], shared: Sequence[int], trained_top_k: Sequence[int],
                    ratio: float) -> list[int]:
    """Per-layer routed top-K that realises the head-weighted activation ``ratio``.

    The number of active heads is ``round(ratio * sum(h))``, the closest any layout gets; shared
    heads stay on. Starting from the trained top-K, routed heads are added (ratio above the
    trained one) in proportion to each layer's unused routed heads, or removed in proportion to
    each layer's removable ones, by largest remainder (ties to the earlier layer). The trained
    ratio gives back the trained top-K. The caller checks that ``ratio`` is reachable.
    """
    routed = [h - s for h, s in zip(heads, shared)]
    k_min = [_min_top_k(h, s) for h, s in zip(heads, shared)]
    wanted = math.floor(ratio * sum(heads) + 0.5) - sum(shared)
    wanted = min(max(wanted, sum(k_min)), sum(routed))
    base = list(trained_top_k)
    if wanted >= sum(base):
        room, change, sign = [r - b for r, b in zip(routed, base)], wanted - sum(base), 1
    else:
        room, change, sign = [b - m for b, m in zip(base, k_min)], sum(base) - wanted, -1
    if change == 0:
        return base
    quotas = [change * r / sum(room) for r in room]
    alloc = [math.floor(q) for q in quotas]
    order = sorted(range(len(room)), key=lambda i: (-(quotas[i] - alloc[i]), i))
    for i in order[:change - sum(alloc)]:
        alloc[i] += 1
    return [b + sign * a for b, a in zip(base, alloc)]


def _per_layer(value: int | Sequence[int] | None, num_layers: int, name: str) -> tuple[int, ...] | None:
    if value is None or isinstance(value, int):
        return None if value is None else (value,) * num_layers
    if len(value) != num_layers:
        raise ValueError(f"{name} has {len(value)} entries for num_layers={num_layers}; give one per layer or an int.")
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class HeadLayout:
    """Heads ``h``, shared heads ``hs`` and routed top-K ``K`` of every layer (``shared`` and
    ``top_k`` None: a dense DiT). Built and checked by :meth:`parse` / :meth:`of_config`."""

    heads: tuple[int, ...]
    shared: tuple[int, ...] | None
    top_k: tuple[int, ...] | None

    @classmethod
    def parse(cls, num_layers: int, num_attention_heads: int | Sequence[int],
              num_shared_heads: int | Sequence[int] | None, top_k: int | Sequence[int] | None) -> "HeadLayout":
        """Expand per-layer settings (an int for every layer, or one per layer) and check them."""
        heads = _per_layer(num_attention_heads, num_layers, "num_attention_heads")
        shared = _per_layer(num_shared_heads, num_layers, "num_shared_heads")
        k = _per_layer(top_k, num_layers, "top_k")
        if (shared is None) != (k is None):
            raise ValueError("num_shared_heads and top_k are given together (MoH) or both None (dense DiT).")
        for i, (h, hs, kk) in enumerate(zip(heads, shared or (), k or ())):
            if not 0 <= hs <= h:
                raise ValueError(f"Layer {i}: num_shared_heads={hs} must be in [0, num_attention_heads={h}].")
            if not (0 <= kk <= h - hs and (kk > 0 or hs == h)):
                raise ValueError(f"Layer {i}: top_k={kk} must be in [1, {h - hs}], the routed heads (0 if none).")
        return cls(heads, shared, k)

    @classmethod
    def of_config(cls, config: Mapping[str, Any]) -> "HeadLayout":
        """The layout of a model config (a preset dict or ``model.config``)."""
        return cls.parse(config["num_layers"], config["num_attention_heads"], config.get("num_shared_heads"),
                         config.get("top_k"))

    @property
    def is_moh(self) -> bool:
        return self.shared is not None

    def activation_ratio(self, top_k: Sequence[int] | None = None) -> float:
        """Head-weighted activation ``sum (hs + K) / sum h`` at ``top_k`` (default the layout's own)."""
        if self.shared is None:
            return 1.0
        return sum(s + k for s, k in zip(self.shared, top_k or self.top_k)) / sum(self.heads)

    def reachable_range(self) -> tuple[float, float]:
        """(lowest, highest) head-weighted ratio a choice of per-layer top-K can realise."""
        if self.shared is None:
            return 1.0, 1.0
        return sum(s + _min_top_k(h, s) for h, s in zip(self.heads, self.shared)) / sum(self.heads), 1.0

    def top_k_for_ratio(self, ratio: float) -> list[int]:
        return top_k_for_ratio(self.heads, self.shared, self.top_k, ratio)


# --------------------------------------------------------------------------------------
# Routing and the dense-masked attention
# --------------------------------------------------------------------------------------


@dataclass
class MoHRouting:
    """What the routers decided for one layer and one batch; statistics computed when read.

    ``gates`` is the dense per-head gate (zero for routed heads a token did not select);
    ``routed_index`` / ``routed_gates`` hold the routed decision in top-K form.
    """

    gates: torch.Tensor  # (B, N, h) float32
    routed_index: torch.Tensor | None = None  # (B, N, K) long, indices into the routed heads
    routed_gates: torch.Tensor | None = None  # (B, N, K) float32
    router_probs: torch.Tensor | None = None  # (B, N, E) float32, softmax of router_routed

    @property
    def routed_usage(self) -> torch.Tensor | None:
        """f_i, the fraction of tokens whose top-K holds routed head i: (E,), no gradient."""
        if self.router_probs is None:
            return None
        return torch.zeros_like(self.router_probs).scatter(-1, self.routed_index, 1.0).mean(dim=(0, 1))  # (E,)

    @property
    def load_balance_loss(self) -> torch.Tensor | None:
        """The release's ``E * sum_i P_i f_i``, P_i the mean router probability (which carries the
        gradient); K at perfect balance. None without routed heads."""
        if self.router_probs is None:
            return None
        return self.router_probs.shape[-1] * (self.router_probs.mean(dim=(0, 1)) * self.routed_usage).sum()

    @property
    def head_usage(self) -> torch.Tensor:
        """(h,) fraction of tokens that used each head (shared heads 1.0)."""
        heads = self.gates.shape[-1]
        routed = 0 if self.router_probs is None else self.router_probs.shape[-1]
        shared = self.gates.new_ones(heads - routed, dtype=torch.float32)  # (hs,)
        return shared if self.router_probs is None else torch.cat([shared, self.routed_usage])  # (h,)


class MoHAttnProcessor:
    """Dense-masked MoH attention, the release's computation and the training path: every head
    by SDPA, each head's output times its gate (zero for unselected routed heads) before the
    output projection. ``routing`` given replaces the layer's own. The call's routing is left on
    ``attn.routing``, where the block reads its statistics."""

    computes_moh = True  # routes and gates itself (``MoHAttention.forward`` applies no gates around it)

    def __call__(self, attn: "MoHAttention", hidden_states: torch.Tensor,
                 routing: MoHRouting | None = None) -> torch.Tensor:
        batch, tokens, _ = hidden_states.shape
        heads, head_dim = attn.heads, attn.inner_dim // attn.heads
        if attn.fused_projections:  # one GEMM for Q, K, V and the routers (fuse_projections)
            sizes = [m.out_features for m in attn.projections()]
            q, k, v, *logits = attn.to_qkv(hidden_states).split(sizes, dim=-1)  # (B, N, rows) each
            # Slices of one GEMM output keep its row stride, which SDPA's CUDA kernels may refuse
            # or mishandle when it is not a multiple of 8 (docs/results.md): copy them out.
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            routing = attn.route(hidden_states, dict(zip(attn.routers(), logits))) if routing is None else routing
        else:  # routers first: their order fixes how backward sums the input's gradient
            routing = attn.route(hidden_states) if routing is None else routing
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)  # (B, N, h*d)
        attn.routing = routing
        q = q.view(batch, tokens, heads, head_dim).transpose(1, 2)  # (B, h, N, d)
        k = k.view(batch, tokens, heads, head_dim).transpose(1, 2)  # (B, h, N, d)
        v = v.view(batch, tokens, heads, head_dim).transpose(1, 2)  # (B, h, N, d)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)  # (B, N, h, d)
        if routing is not None:
            out = out * routing.gates.unsqueeze(-1).to(out.dtype)  # (B, N, h, d)
        out = attn.to_out[0](out.reshape(batch, tokens, heads * head_dim))  # (B, N, D)
        return attn.to_out[1](out)  # (B, N, D), dropout


class MoHAttention(Attention):
    """diffusers ``Attention`` with Mixture-of-Head routers (bias-free linears, saved with it):

    ``router_routed`` (release ``wg``, (h - hs, D)) when there are routed heads, ``router_mix``
    (``wg_0``, (2, D)) when there are routed and shared heads, ``router_shared`` (``wg_1``,
    (hs, D)) when hs > 1. ``num_shared_heads=None``: a plain dense layer (DiT baseline).

    ``forward`` returns the hidden states and leaves the call's :class:`MoHRouting` on ``routing``.
    Any diffusers processor can be set; on a MoH layer it still computes MoH.
    """

    _default_processor_cls = MoHAttnProcessor

    def __init__(self, query_dim: int, heads: int, dim_head: int, num_shared_heads: int | None = None,
                 top_k: int | None = None, gate_mode: str = "release", bias: bool = True):
        super().__init__(query_dim=query_dim, heads=heads, dim_head=dim_head, bias=bias, out_bias=True,
                         processor=MoHAttnProcessor())
        self.gate_mode = gate_mode
        self.is_moh = num_shared_heads is not None
        self.num_shared_heads = num_shared_heads if self.is_moh else heads
        self.num_routed_heads = heads - self.num_shared_heads
        self.top_k = top_k if self.is_moh else 0
        routed, shared = self.num_routed_heads, self.num_shared_heads
        self.router_routed = nn.Linear(query_dim, routed, bias=False) if routed else None
        self.router_mix = nn.Linear(query_dim, 2, bias=False) if routed and shared > 0 else None
        self.router_shared = nn.Linear(query_dim, shared, bias=False) if self.is_moh and shared > 1 else None
        self.routing: MoHRouting | None = None  # the last call's; the block reads and clears it

    def routers(self) -> dict[str, nn.Linear]:
        """The router linears this layer has, by name, in the order they follow Q, K, V when fused."""
        names = ("router_shared", "router_routed", "router_mix")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def projections(self) -> list[nn.Linear]:
        return [self.to_q, self.to_k, self.to_v, *self.routers().values()]

    def route(self, x: torch.Tensor, logits: dict[str, torch.Tensor] | None = None) -> MoHRouting | None:
        """Gates of every head for every token of ``x`` (B, N, D); None for a dense layer.

        Release gates: routed ``K * p_j / sum_topK p`` with ``p = softmax(W_r x)``; shared
        ``hs * softmax(W_s x)``; with both kinds, shared gates times ``a_0`` and routed times
        ``a_1``, ``a = 2 * softmax(W_h x)``. A single shared head gets a constant gate of 1 (the
        release crashes there). ``paper`` drops the K, hs and 2 factors and the renormalisation.
        Softmaxes in float32. ``logits``: the routers' outputs when already computed.
        """
        if not self.is_moh:
            return None
        if logits is None:
            logits = {name: router(x) for name, router in self.routers().items()}  # (B, N, rows) each
        release, hs, k = self.gate_mode == "release", self.num_shared_heads, self.top_k
        parts = []
        if hs > 1:
            shared = logits["router_shared"].softmax(dim=-1, dtype=torch.float32)  # (B, N, hs)
            parts.append(shared * hs if release else shared)
        elif hs == 1:
            parts.append(x.new_ones(*x.shape[:2], 1, dtype=torch.float32))  # (B, N, 1)
        if not self.num_routed_heads:
            return MoHRouting(parts[0])
        probs = logits["router_routed"].softmax(dim=-1, dtype=torch.float32)  # (B, N, E)
        top_p, routed_index = probs.topk(k, dim=-1)  # (B, N, K)
        routed_gates = k * top_p / top_p.sum(dim=-1, keepdim=True) if release else top_p  # (B, N, K)
        if hs > 0:
            mix = logits["router_mix"].softmax(dim=-1, dtype=torch.float32)  # (B, N, 2)
            mix = mix * 2 if release else mix
            parts[0] = parts[0] * mix[..., :1]  # (B, N, hs)
            routed_gates = routed_gates * mix[..., 1:]  # (B, N, K)
        parts.append(torch.zeros_like(probs).scatter(-1, routed_index, routed_gates))  # (B, N, E)
        gates = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]  # (B, N, h)
        return MoHRouting(gates, routed_index, routed_gates, probs)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, N, D) -> (B, N, D). MoH's processors (``computes_moh``) route and gate themselves; any other
        processor (diffusers' ``AttnProcessor2_0``, a user's) runs with this layer's gates applied
        where diffusers' processors hand the heads, (B, N, h*d), to ``to_out[0]``."""
        self.routing = None
        if not self.is_moh or getattr(self.processor, "computes_moh", False):
            return self.processor(self, hidden_states)
        routing = self.route(hidden_states)

        def gate_heads(_to_out, args):
            if self.routing is not None:  # a processor wrapping MoH's own has gated the heads
                return None
            heads = args[0].unflatten(-1, (self.heads, -1))  # (B, N, h, d)
            return ((heads * routing.gates.unsqueeze(-1).to(heads.dtype)).flatten(-2), *args[1:])  # (B, N, h*d)

        hook = self.to_out[0].register_forward_pre_hook(gate_heads)
        try:
            out = self.processor(self, hidden_states)
        finally:
            hook.remove()
        if self.routing is None:
            self.routing = routing
        return out

    @torch.no_grad()
    def fuse_projections(self, fuse: bool = True) -> None:
        """diffusers' switch, for inference: Q, K, V and the routers as one GEMM, ``to_qkv``, a
        copy of their weights (same values to float rounding). ``unfuse_projections`` undoes it."""
        linears = self.projections()
        weight = torch.cat([m.weight for m in linears])  # (3 h d + router rows, D)
        self.to_qkv = nn.Linear(weight.shape[1], weight.shape[0], bias=self.use_bias, device=weight.device,
                                dtype=weight.dtype)
        self.to_qkv.weight.copy_(weight)
        if self.use_bias:  # the routers have no bias
            self.to_qkv.bias.copy_(torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                                              for m in linears]))
        self.fused_projections = fuse

    def unfuse_projections(self) -> None:
        if hasattr(self, "to_qkv"):
            del self.to_qkv
        self.fused_projections = False


# --------------------------------------------------------------------------------------
# Block and model
# --------------------------------------------------------------------------------------


class MoHDiTBlock(nn.Module):
    """DiT block with adaLN-Zero conditioning (Peebles & Xie 2023, Fig. 3) and MoH attention."""

    def __init__(self, dim: int, heads: int, head_dim: int, num_shared_heads: int | None, top_k: int | None,
                 mlp_ratio: float = 4.0, gate_mode: str = "release", norm_eps: float = 1e-6):
        super().__init__()
        # No embedder in the norm: the model embeds timestep and label once for all blocks
        # (diffusers' DiT keeps a copy in every block).
        self.norm1 = AdaLayerNormZero(dim, num_embeddings=None)
        self.norm1.norm.eps = norm_eps
        self.attn1 = MoHAttention(dim, heads, head_dim, num_shared_heads, top_k, gate_mode)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=norm_eps)
        self.ff = FeedForward(dim, mult=mlp_ratio, activation_fn="gelu-approximate")

    def forward(self, x: torch.Tensor, emb: torch.Tensor, need_stats: bool = False):
        """(B, N, D) -> (B, N, D), and with ``need_stats`` the attention's load-balance loss
        (None without routed heads) and head usage ((h,), None for a dense layer)."""
        norm_x, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, emb=emb)  # (B, N, D), 4 x (B, D)
        attn_out = self.attn1(norm_x)  # (B, N, D)
        routing, self.attn1.routing = self.attn1.routing, None  # read and cleared: no tensors kept
        x = x + gate_msa.unsqueeze(1) * attn_out  # (B, N, D)
        norm_x = self.norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]  # (B, N, D)
        x = x + gate_mlp.unsqueeze(1) * self.ff(norm_x)  # (B, N, D)
        if routing is None or not need_stats:
            return x, None, None
        return x, routing.load_balance_loss, routing.head_usage


class DiTTimestepLabelEmbedding(CombinedTimestepLabelEmbeddings):
    """DiT's timestep + class embedding: frequencies ``exp(-ln(1e4) i / 128)`` (diffusers' uses
    ``i / 127``). The null-class row (``num_classes``) always exists: guidance needs it."""

    def __init__(self, num_classes: int, embedding_dim: int, class_dropout_prob: float):
        super().__init__(num_classes, embedding_dim, class_dropout_prob=1.0)
        self.time_proj = Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.class_embedder.dropout_prob = class_dropout_prob

    def forward(self, timestep: torch.Tensor, class_labels: torch.Tensor, hidden_dtype=None,
                force_drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, D). ``force_drop_ids`` (B,): where non-zero the label becomes the null class and
        nothing is drawn; None: in training each label dropped with ``class_dropout_prob``."""
        timesteps_emb = self.timestep_embedder(self.time_proj(timestep).to(dtype=hidden_dtype))  # (B, D)
        if force_drop_ids is None:
            return timesteps_emb + self.class_embedder(class_labels)
        labels = torch.where(force_drop_ids.to(class_labels.device) != 0, self.class_embedder.num_classes,
                             class_labels)  # (B,)
        return timesteps_emb + self.class_embedder.embedding_table(labels)  # (B, D)


@dataclass
class MoHDiTTransformer2DModelOutput(BaseOutput):
    """``sample`` (B, C_out, H, W): eps, then with learned sigma the variance interpolation values;
    ``load_balance_loss``: mean over the routed layers (zero if none), when asked or training;
    ``head_usage``: per layer (h_l,), the fraction of tokens that used each head, when asked."""

    sample: torch.Tensor
    load_balance_loss: torch.Tensor | None = None
    head_usage: list[torch.Tensor] | None = None


class MoHDiTTransformer2DModel(ModelMixin, ConfigMixin, AttentionMixin, PeftAdapterMixin):
    """Class-conditional DiT with Mixture-of-Head attention (or dense attention).

    Args:
        sample_size: input height and width (latent pixels).
        patch_size: patch side; tokens = (sample_size / patch_size) ** 2.
        in_channels: input channels (4 for SD-VAE latents, 3 in pixel space).
        out_channels: output channels; default ``2 * in_channels`` with learned sigma.
        learn_sigma: predict the variance interpolation values too (DiT / IDDPM).
        hidden_size: transformer width D.
        num_layers: number of blocks.
        num_attention_heads: heads per layer (an int for all layers, or a list).
        attention_head_dim: channels per head; a layer's inner width is heads * head_dim.
        num_shared_heads: always-active heads per layer (int or list); None for a dense DiT.
        top_k: routed heads each token selects, per layer (int or list); None for a dense DiT.
        mlp_ratio: MLP hidden width / D.
        num_classes: number of classes; id ``num_classes`` is the null class (guidance).
        class_dropout_prob: label dropout in training.
        gate_mode: ``"release"`` (the authors' checkpoint) or ``"paper"`` (Eq. 5-6).
        norm_eps: LayerNorm epsilon (DiT: 1e-6).
        class_names: names of the classes, index = class id (saved with the model).
        label_embedding_init_std: std of the label table's initialisation: DiT's 0.02 suits long
            runs; 1.0 lets conditioning take hold within a few thousand steps (the CPU demo).

    diffusers' LoRA API works on it (``add_adapter``, ``load_lora_adapter``, ...; needs ``peft``),
    adapters may target the routers too, and ``cross_attention_kwargs={"scale": s}`` scales a LoRA
    for one call.
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
        if gate_mode not in ("release", "paper"):
            raise ValueError(f"gate_mode={gate_mode!r}; choose 'release' or 'paper'.")
        self.layout = HeadLayout.parse(num_layers, num_attention_heads, num_shared_heads, top_k)
        heads, shared, k = self.layout.heads, self.layout.shared, self.layout.top_k
        self.out_channels = out_channels if out_channels is not None else in_channels * (2 if learn_sigma else 1)
        self.gradient_checkpointing = False

        self.pos_embed = PatchEmbed(height=sample_size, width=sample_size, patch_size=patch_size,
                                    in_channels=in_channels, embed_dim=hidden_size)
        self.time_class_embed = DiTTimestepLabelEmbedding(num_classes, hidden_size, class_dropout_prob)
        self.transformer_blocks = nn.ModuleList([
            MoHDiTBlock(hidden_size, heads[i], attention_head_dim, None if shared is None else shared[i],
                        None if k is None else k[i], mlp_ratio, gate_mode, norm_eps)
            for i in range(num_layers)
        ])
        self.norm_out = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=norm_eps)
        self.proj_out_1 = nn.Linear(hidden_size, 2 * hidden_size)
        self.proj_out_2 = nn.Linear(hidden_size, patch_size * patch_size * self.out_channels)
        self.initialize_weights()

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "MoHDiTTransformer2DModel":
        """A randomly initialised model of a preset (``moh_dit.models.presets``), e.g.
        ``from_preset("MoH-DiT-XL/2-90", sample_size=64, num_classes=10)``."""
        from moh_dit.models.presets import PRESETS  # the presets are moh-dit's, not part of this file

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}.")
        return cls(**{**copy.deepcopy(PRESETS[name]), **overrides})

    def initialize_weights(self) -> None:
        """DiT's initialisation: xavier-uniform linears with zero bias, the patch embedding as a
        linear, N(0, 0.02) timestep MLP, the label table N(0, ``label_embedding_init_std``), zero
        adaLN modulation and output layer (so every block starts as the identity)."""

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
        return self.layout.is_moh

    @property
    def top_k_per_layer(self) -> list[int]:
        """The routed top-K each layer uses now (0 for dense or all-shared layers)."""
        return [block.attn1.top_k for block in self.transformer_blocks]

    @property
    def head_activation_ratio(self) -> float:
        """The head-weighted activation ``sum (hs + K) / sum h`` now (1.0 for a dense DiT)."""
        return self.layout.activation_ratio(self.top_k_per_layer)

    @property
    def head_activation_range(self) -> tuple[float, float]:
        """(lowest, highest) ratio ``set_head_activation_ratio`` accepts."""
        return self.layout.reachable_range()

    def set_head_activation_ratio(self, ratio: float | None) -> float:
        """Set every layer's routed top-K to realise the head-weighted activation ``ratio`` by
        :func:`top_k_for_ratio`'s rule; None restores the trained top-K. Returns the realised
        ratio; ValueError outside :attr:`head_activation_range`."""
        low, high = self.head_activation_range
        if ratio is not None and not low - 1e-9 <= ratio <= high + 1e-9:  # also refuses nan
            raise ValueError(f"head_activation_ratio={ratio} is outside this model's reachable range [{low:.4f}, "
                             f"{high:.4f}] (shared heads are always active).")
        if self.is_moh:
            top_k = self.layout.top_k if ratio is None else self.layout.top_k_for_ratio(float(ratio))
            for block, k in zip(self.transformer_blocks, top_k):
                block.attn1.top_k = k
        return self.head_activation_ratio

    def set_sparse_inference(self, enabled: bool) -> None:
        """Head-sparse attention (``moh_dit.models.sparse``: unselected routed heads cost nothing;
        the same result to float rounding) on every MoH layer, or back to dense-masked."""
        from moh_dit.models.sparse import MoHSparseAttnProcessor  # moh-dit's, not part of this file

        for block in self.transformer_blocks:
            if block.attn1.is_moh:
                block.attn1.set_processor(MoHSparseAttnProcessor() if enabled else MoHAttnProcessor())

    def set_default_attn_processor(self) -> None:
        """MoH's dense-masked processor on every layer."""
        self.set_attn_processor(MoHAttnProcessor())

    def fuse_qkv_projections(self) -> None:
        """Q, K, V and the routers of every layer as one GEMM (inference; see ``fuse_projections``)."""
        for block in self.transformer_blocks:
            block.attn1.fuse_projections()

    def unfuse_qkv_projections(self) -> None:
        for block in self.transformer_blocks:
            block.attn1.unfuse_projections()

    # ---------------------------------------------------------------- forward
    @apply_lora_scale("cross_attention_kwargs")
    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor | int | float,
        class_labels: torch.LongTensor,
        cross_attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
        output_load_balance_loss: bool | None = None,
        output_head_usage: bool = False,
        force_drop_ids: torch.Tensor | None = None,
    ) -> MoHDiTTransformer2DModelOutput | tuple:
        """Predict eps (and the variance values) for noisy inputs.

        Args:
            hidden_states: (B, C, H, W) noisy latents or images.
            timestep: (B,) or a scalar diffusion step.
            class_labels: (B,) class ids; ``num_classes`` is the null class.
            cross_attention_kwargs: diffusers' per-call options; ``{"scale": s}`` scales LoRA layers.
            return_dict: a ``MoHDiTTransformer2DModelOutput``, else ``(sample, load_balance_loss, head_usage)``.
            output_load_balance_loss: compute the load-balance loss; default: in training.
            output_head_usage: return per-layer head usage.
            force_drop_ids: (B,) label dropout decided by the caller (non-zero: null class), so that
                nothing is drawn inside the forward (a compiled one draws from its own generator).
        """
        want_lb = self.training if output_load_balance_loss is None else output_load_balance_loss
        need_stats = want_lb or output_head_usage
        batch, size = hidden_states.shape[0], hidden_states.shape[-1] // self.config.patch_size
        timestep = torch.as_tensor(timestep, device=hidden_states.device).reshape(-1).expand(batch)  # (B,)

        # PatchEmbed returns a transposed view (D has stride T); carried through the blocks it
        # would make every elementwise op strided: one copy here is far cheaper.
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
        x = torch.einsum("nhwpqc->nchpwq", x)  # (B, C_out, h, p, w, p)
        sample = x.reshape(-1, c_out, size * p, size * p)  # (B, C_out, H, W)

        lb_loss = None
        if want_lb:
            lb_loss = torch.stack(lb_losses).mean() if lb_losses else sample.new_zeros((), dtype=torch.float32)
        head_usage = usage if output_head_usage else None
        if not return_dict:
            return sample, lb_loss, head_usage
        return MoHDiTTransformer2DModelOutput(sample=sample, load_balance_loss=lb_loss, head_usage=head_usage)


@contextlib.contextmanager
def head_activation(model: MoHDiTTransformer2DModel, ratio: float | None) -> Iterator[float]:
    """Run the block with ``model`` at head activation ``ratio`` (None: as it is); yields the
    realised ratio. The per-layer top-K is given back exactly on exit, also on an error."""
    saved = model.top_k_per_layer
    try:
        yield model.head_activation_ratio if ratio is None else model.set_head_activation_ratio(ratio)
    finally:
        for block, k in zip(model.transformer_blocks, saved):
            block.attn1.top_k = k
