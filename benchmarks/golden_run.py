"""Fingerprints of what the package computes, to show that a refactor changed no result.

Runs, on the CPU and offline, in a scratch folder: model forwards (MoH and dense tiny models, the
trained and the lowest head ratio, the head-sparse and dense-masked paths, training mode with the
load-balance loss), pipeline images (DDPM, DDIM, DPM-Solver; a constant ratio and a schedule), a
training run of 4 steps and the same run stopped at 2 and resumed (their final weights and loss
logs), and a sample folder made from the run. Prints and writes a JSON of SHA-256 digests;
run it before and after a change and compare the two files (they must be equal):

    python benchmarks/golden_run.py --output before.json
    python benchmarks/golden_run.py --output after.json && cmp before.json after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch


def digest(value) -> str:
    if torch.is_tensor(value):
        value = value.detach().cpu().contiguous().numpy()
    if isinstance(value, (list, tuple)):
        return hashlib.sha256("".join(digest(v) for v in value).encode()).hexdigest()[:16]
    return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]


def randomized(model, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model.eval()


def forwards() -> dict[str, str]:
    from moh_dit import MoHDiTTransformer2DModel

    out = {}
    for preset in ("MoH-DiT-Tiny/2", "DiT-Tiny/2", "MoH-DiT-Tiny"):
        model = randomized(MoHDiTTransformer2DModel.from_preset(preset))
        cfg = model.config
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(3, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=generator)
        t, y = torch.tensor([999, 500, 3]), torch.tensor([0, 1, cfg.num_classes])
        low = model.head_activation_range[0]
        for ratio in (None, low):
            model.set_head_activation_ratio(ratio)
            for sparse in (False, True):
                model.set_sparse_inference(sparse)
                with torch.no_grad():
                    result = model(x, t, y, output_head_usage=True)
                out[f"{preset} ratio={ratio} sparse={sparse}"] = digest([result.sample, *result.head_usage])
        model.set_head_activation_ratio(None)
        model.set_sparse_inference(False)
        model.train()
        result = model(x, t, y, force_drop_ids=torch.tensor([0, 1, 0]))
        loss = result.sample.square().mean() + (result.load_balance_loss if result.load_balance_loss is not None else 0)
        loss.backward()
        out[f"{preset} train"] = digest([result.sample, *(p.grad for p in model.parameters() if p.grad is not None)])
    return out


def pipelines() -> dict[str, str]:
    from moh_dit import MoHDiTPipeline, MoHDiTTransformer2DModel
    from moh_dit.diffusion import make_scheduler

    model = randomized(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny/2"))
    out = {}
    for name in ("ddpm", "ddim", "dpm"):
        pipe = MoHDiTPipeline(transformer=model, scheduler=make_scheduler(name, clip_sample=name != "dpm"))
        pipe.set_progress_bar_config(disable=True)
        for ratio in (None, model.head_activation_range[0], "linear:0.5:1.0"):
            images = pipe([0, 5, 11], guidance_scale=1.5, num_inference_steps=6, head_activation_ratio=ratio,
                          seeds=[0, 1, 2], output_type="np")
            out[f"pipeline {name} ratio={ratio}"] = digest([torch.from_numpy(images.images), *images.head_usage])
    return out


def moh_dit(*args, cwd):
    subprocess.run([sys.executable, "-m", "moh_dit.commands", *map(str, args), "-q"], cwd=cwd, check=True)


def run_files(run: Path) -> str:
    from safetensors.torch import load_file

    weights = sorted(p for p in (run / "final").rglob("*.safetensors") if "vae" not in p.parts)
    tensors = [t for p in weights for _, t in sorted(load_file(p).items())]
    return digest(tensors)


def training_and_sampling(work: Path) -> dict[str, str]:
    moh_dit("make-demo-dataset", "--output-dir", "data", "--images-per-class", "2", "--image-size", "16", cwd=work)
    common = ["--preset", "MoH-DiT-Tiny/2", "--data-dir", "data", "--vae", "none", "--image-size", "16",
              "--global-batch-size", "4", "--num-workers", "0", "--report-to", "none", "--checkpoint-every", "2",
              "--log-every", "1", "--seed", "0"]
    moh_dit("train", *common, "--output-dir", "whole", "--max-steps", "4", cwd=work)
    moh_dit("train", *common, "--output-dir", "halves", "--max-steps", "2", cwd=work)
    moh_dit("train", *common, "--output-dir", "halves", "--max-steps", "4", "--resume", "latest", cwd=work)
    out = {"train 4 steps": run_files(work / "whole"), "train 2 + resume to 4": run_files(work / "halves")}
    moh_dit("sample", "--model", "whole/final", "--output-dir", "samples", "--num-samples", "6",
            "--per-device-batch-size", "4", "--num-inference-steps", "5", "--guidance-scale", "1.5", cwd=work)
    with np.load(work / "samples" / "samples.npz") as npz:
        out["sample folder npz"] = digest([torch.from_numpy(npz[k]) for k in sorted(npz.files)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="JSON file to write the digests to")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {**forwards(), **pipelines()}
    with tempfile.TemporaryDirectory() as work:
        results.update(training_and_sampling(Path(work)))
    text = json.dumps(results, indent=1, sort_keys=True)
    args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
