"""How far a diffusers DiTTransformer2DModel and its conversion to MoHDiTTransformer2DModel differ.

    python benchmarks/compare_diffusers_dit.py --preset DiT-S/2

The conversion folds diffusers' per-block embedders into one and follows the original DiT:
timestep frequencies exp(-ln(1e4) i / 128) (diffusers: / 127) and LayerNorm eps 1e-6 in the
MLP branch (diffusers: 1e-5). This script measures both effects on random weights
(N(0, 0.02) everywhere, so no layer is zero) and prints them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from diffusers.models.embeddings import get_timestep_embedding

from moh_dit.hub.convert import convert_checkpoint
from moh_dit.models.presets import PRESETS

from common import diffusers_dit, randomize_weights_


def compare(preset: str = "DiT-S/2", batch_size: int = 4, seed: int = 0) -> dict[str, float]:
    cfg = PRESETS[preset]
    if cfg.get("num_shared_heads") is not None:
        raise ValueError(f"{preset} is a MoH preset; diffusers has no MoH model. Use a dense DiT preset.")
    t = torch.arange(1000)
    emb_dit = get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
    emb_diffusers = get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=1)
    torch.manual_seed(seed)
    dit = randomize_weights_(diffusers_dit(preset).eval())
    with torch.no_grad():
        shared = dit.transformer_blocks[0].norm1.emb.state_dict()
        for block in dit.transformer_blocks[1:]:  # a converted DiT holds identical copies
            block.norm1.emb.load_state_dict(shared)
    with tempfile.TemporaryDirectory() as tmp:
        dit.save_pretrained(tmp)
        ours = convert_checkpoint(tmp, preset).eval()
    s = cfg["sample_size"]
    x = torch.randn(batch_size, cfg["in_channels"], s, s)
    steps = torch.linspace(0, 999, batch_size).long()
    y = torch.arange(batch_size) % cfg["num_classes"]
    with torch.no_grad():
        a = dit(x, steps, y).sample
        b = ours(x, steps, y).sample
    return {
        "timestep_embedding_max_abs_diff": (emb_dit - emb_diffusers).abs().max().item(),
        "output_max_abs_diff": (a - b).abs().max().item(),
        "output_relative_l2_diff": ((a - b).norm() / a.norm()).item(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="DiT-S/2", choices=[n for n in PRESETS if n.startswith("DiT")])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    result = compare(args.preset, args.batch_size, args.seed)
    print(f"{args.preset}, random N(0, 0.02) weights, t = 0..999")
    for key, value in result.items():
        print(f"  {key:<34} {value:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
