"""Training-input throughput: encoding images with the VAE on the fly vs reading the latent cache.

    python benchmarks/benchmark_data.py --num-images 8 --image-size 256

Uses generated JPEGs and an AutoencoderKL with the SD VAE's architecture (random weights:
the speed does not depend on them), so it runs offline. Both paths produce the training
latents of the same images, measured in one run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL
from PIL import Image

from moh_dit.utils.cli import run_cli
from moh_dit.utils.logging import get_verbosity, set_verbosity
from moh_dit.data.datasets import ImageFolderDataset
from moh_dit.data.latents import LatentDataset, extract_latents

from common import pick_device, sync


def run(num_images: int = 8, image_size: int = 256, batch_size: int = 4, device: str | None = None) -> dict:
    dev = pick_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rng = np.random.default_rng(0)
        for i in range(num_images):
            folder = tmp / "images" / f"class_{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            arr = rng.integers(0, 256, (image_size + 64, image_size + 32, 3), dtype=np.uint8)
            Image.fromarray(arr).save(folder / f"{i}.jpg", quality=90)
        torch.manual_seed(0)
        vae = AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
        ).to(dev).eval()
        vae.save_pretrained(tmp / "vae")

        images = ImageFolderDataset(tmp / "images", image_size)
        start = time.perf_counter()
        with torch.no_grad():
            for i in range(0, num_images, batch_size):
                batch = torch.stack([images[(j, 0)][0] for j in range(i, min(i + batch_size, num_images))]).to(dev)
                vae.encode(batch).latent_dist.sample()
        sync(dev)
        on_the_fly = num_images / (time.perf_counter() - start)

        level = get_verbosity()  # building the cache is set-up, not this benchmark's output
        set_verbosity("warning")
        try:
            extract_latents(tmp / "images", tmp / "vae", tmp / "cache", image_size, batch_size=batch_size,
                            num_workers=0, device=dev, progress=False)
        finally:
            set_verbosity(level)
        cache = LatentDataset(tmp / "cache")
        reads = max(1000, num_images)
        start = time.perf_counter()
        for i in range(reads):
            cache[(i % num_images, i // num_images)]
        from_cache = reads / (time.perf_counter() - start)
    return {"device": str(dev), "image_size": image_size, "on_the_fly_images_per_s": on_the_fly,
            "cache_samples_per_s": from_cache, "speedup": from_cache / on_the_fly}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-images", type=int, default=8)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default=None)
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    r = run(args.num_images, args.image_size, args.batch_size, args.device)
    print(f"{r['device']}, {r['image_size']}px: on the fly (crop + SD-VAE encode) {r['on_the_fly_images_per_s']:.2f} images/s; "
          f"latent cache {r['cache_samples_per_s']:.0f} samples/s ({r['speedup']:.0f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, parse_args))
