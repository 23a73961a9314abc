"""Model presets by the names users know, as plain data (no torch: ``--preset`` choices and
``--help`` stay fast).

Every preset is a dict of ``MoHDiTTransformer2DModel`` arguments. MoH layouts follow the
authors' release: per layer the number of heads, of shared heads and the routed top-K; the
head-weighted activation ``sum (hs + K) / sum h`` gives the "-75" / "-90" names. Dense DiT
presets have no routers (``num_shared_heads=None``) and match facebookresearch/DiT.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "preset_names"]


def _repeat(*runs: tuple[int, int]) -> list[int]:
    """``_repeat((8, 9), (16, 10))`` -> nine 8s followed by ten 16s."""
    out: list[int] = []
    for value, count in runs:
        out += [value] * count
    return out


# ImageNet 256x256 through the SD VAE: 32x32x4 latents, learned sigma, 1000 classes + null.
_IMAGENET = dict(sample_size=32, in_channels=4, learn_sigma=True, num_classes=1000, class_dropout_prob=0.1)

_DIT_SIZES = {
    "S": dict(num_layers=12, hidden_size=384, num_attention_heads=6),
    "B": dict(num_layers=12, hidden_size=768, num_attention_heads=12),
    "L": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
    "XL": dict(num_layers=28, hidden_size=1152, num_attention_heads=16),
}

PRESETS: dict[str, dict[str, Any]] = {}

for _size, _dims in _DIT_SIZES.items():
    for _patch in (2, 4, 8):
        PRESETS[f"DiT-{_size}/{_patch}"] = dict(
            _IMAGENET,
            patch_size=_patch,
            attention_head_dim=_dims["hidden_size"] // _dims["num_attention_heads"],
            **_dims,
        )

PRESETS.update(
    {
        "MoH-DiT-XL/2-90": dict(
            _IMAGENET, patch_size=2, num_layers=28, hidden_size=1152, attention_head_dim=72,
            num_attention_heads=_repeat((8, 9), (16, 10), (24, 9)),
            num_shared_heads=_repeat((8, 9), (16, 10), (16, 9)),
            top_k=_repeat((0, 19), (3, 9)),
        ),
        "MoH-DiT-XL/2-75": dict(
            _IMAGENET, patch_size=2, num_layers=28, hidden_size=1152, attention_head_dim=72,
            num_attention_heads=_repeat((8, 9), (16, 10), (24, 9)),
            num_shared_heads=_repeat((8, 9), (10, 10), (14, 9)),
            top_k=_repeat((0, 9), (2, 10), (2, 9)),
        ),
        "MoH-DiT-L/2-90": dict(
            _IMAGENET, patch_size=2, num_layers=24, hidden_size=1024, attention_head_dim=64,
            num_attention_heads=_repeat((8, 8), (16, 8), (24, 8)),
            num_shared_heads=_repeat((8, 8), (16, 8), (16, 8)),
            top_k=_repeat((0, 16), (3, 8)),
        ),
        "MoH-DiT-L/2-75": dict(
            _IMAGENET, patch_size=2, num_layers=24, hidden_size=1024, attention_head_dim=64,
            num_attention_heads=_repeat((8, 8), (16, 8), (24, 8)),
            num_shared_heads=_repeat((8, 8), (8, 8), (12, 8)),
            top_k=_repeat((0, 8), (4, 8), (4, 8)),
        ),
        "MoH-DiT-B/2-90": dict(
            _IMAGENET, patch_size=2, num_layers=12, hidden_size=768, attention_head_dim=64,
            num_attention_heads=12,
            num_shared_heads=[6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 12, 12],
            top_k=_repeat((4, 10), (0, 2)),
        ),
        "MoH-DiT-B/2-75": dict(
            _IMAGENET, patch_size=2, num_layers=12, hidden_size=768, attention_head_dim=64,
            num_attention_heads=12,
            num_shared_heads=[4, 4, 6, 6, 6, 6, 6, 6, 6, 6, 12, 12],
            top_k=[2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 0, 0],
        ),
        "MoH-DiT-S/2-90": dict(
            _IMAGENET, patch_size=2, num_layers=12, hidden_size=384, attention_head_dim=64,
            num_attention_heads=6,
            num_shared_heads=_repeat((3, 8), (6, 4)),
            top_k=_repeat((2, 8), (0, 4)),
        ),
        "MoH-DiT-S/2-75": dict(
            _IMAGENET, patch_size=2, num_layers=12, hidden_size=384, attention_head_dim=64,
            num_attention_heads=6,
            num_shared_heads=[2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 6, 6],
            top_k=[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0],
        ),
        # Tiny presets for tests and the CPU demo: 32x32 RGB in pixel space, patch 4 (64
        # tokens, small enough to train on a laptop CPU). The MoH layout
        # covers every gate case of the release: all-shared (K=0), a single shared head
        # (hs=1, where the release crashes), no shared head (hs=0) and ordinary layers.
        # Head-weighted activation (4+3+3+3+3+2)/24 = 0.75.
        "MoH-DiT-Tiny": dict(
            sample_size=32, in_channels=3, learn_sigma=True, num_classes=10, class_dropout_prob=0.1,
            patch_size=4, num_layers=6, hidden_size=128, attention_head_dim=32, num_attention_heads=4,
            num_shared_heads=[4, 2, 2, 1, 2, 0],
            top_k=[0, 1, 1, 2, 1, 2],
        ),
        "DiT-Tiny": dict(
            sample_size=32, in_channels=3, learn_sigma=True, num_classes=10, class_dropout_prob=0.1,
            patch_size=4, num_layers=6, hidden_size=128, attention_head_dim=32, num_attention_heads=4,
        ),
        # The CPU demo's model: MoH-DiT-Tiny's layers at 16x16 px with patch 2 (the same 64
        # tokens and cost, but 2x2-pixel patches, so no visible 4x4 patch grid), and a label
        # table initialised at unit scale so conditioning takes hold within minutes (see
        # label_embedding_init_std in docs/demo.md).
        "MoH-DiT-Tiny/2": dict(
            sample_size=16, in_channels=3, learn_sigma=True, num_classes=12, class_dropout_prob=0.1,
            patch_size=2, num_layers=6, hidden_size=128, attention_head_dim=32, num_attention_heads=4,
            num_shared_heads=[4, 2, 2, 1, 2, 0],
            top_k=[0, 1, 1, 2, 1, 2],
            label_embedding_init_std=1.0,
        ),
        "DiT-Tiny/2": dict(
            sample_size=16, in_channels=3, learn_sigma=True, num_classes=12, class_dropout_prob=0.1,
            patch_size=2, num_layers=6, hidden_size=128, attention_head_dim=32, num_attention_heads=4,
            label_embedding_init_std=1.0,
        ),
    }
)


def preset_names() -> list[str]:
    """Every preset's name, e.g. for argparse ``choices``."""
    return list(PRESETS)


# Upcycled layouts: MoH layouts that keep a dense DiT's head count in every layer, so that
# ``moh_dit.hub.upcycle`` can carry every dense weight over (the paper's MoH-DiT presets change
# the head count per layer). As in the paper's layouts the first layers keep every head and the
# later ones route, with the paper's routed pools: XL-75 has E=6, K=2 in layers 9-18 and E=10,
# K=2 in layers 19-27; XL-90 has E=8, K=3 in layers 19-27.
for _name, _dense, _shared, _k in (
    # 144 + 120 + 72 = 336 of 448 heads active: 0.75
    ("MoH-DiT-XL/2-up75", "DiT-XL/2", _repeat((16, 9), (10, 10), (6, 9)), _repeat((0, 9), (2, 10), (2, 9))),
    # 304 + 99 = 403 of 448: 0.8996, as MoH-DiT-XL/2-90
    ("MoH-DiT-XL/2-up90", "DiT-XL/2", _repeat((16, 19), (8, 9)), _repeat((0, 19), (3, 9))),
    # the layout of MoH-DiT-Tiny (which keeps 4 heads per layer): 18 of 24, 0.75
    ("MoH-DiT-Tiny-up75", "DiT-Tiny", [4, 2, 2, 1, 2, 0], [0, 1, 1, 2, 1, 2]),
    # 12 + 4 + 3 + 3 = 22 of 24: 0.9167, the nearest to 0.9 with whole heads
    ("MoH-DiT-Tiny-up90", "DiT-Tiny", [4, 4, 4, 3, 2, 2], [0, 0, 0, 1, 1, 1]),
    # the CPU demo's size (16 px, patch 2; the layout of MoH-DiT-Tiny/2): the upcycling demo
    ("MoH-DiT-Tiny/2-up75", "DiT-Tiny/2", [4, 2, 2, 1, 2, 0], [0, 1, 1, 2, 1, 2]),
):
    _layers = PRESETS[_dense]["num_layers"]
    PRESETS[_name] = dict(PRESETS[_dense], num_attention_heads=[PRESETS[_dense]["num_attention_heads"]] * _layers,
                          num_shared_heads=_shared, top_k=_k)
