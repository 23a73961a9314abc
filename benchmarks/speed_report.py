"""The speed report: training step, sampling and forward speed of DiT-XL/2 and MoH-DiT-XL/2-90
and -75, measured side by side in one run, as JSON and a markdown table.

    python benchmarks/speed_report.py train   --json OUT/train.json   --markdown OUT/train.md
    python benchmarks/speed_report.py sample  --json OUT/sample.json  --markdown OUT/sample.md
    python benchmarks/speed_report.py forward --json OUT/forward.json --markdown OUT/forward.md
    python benchmarks/speed_report.py train --tiny     # the same code at toy sizes (CPU smoke test)

``train``: for each model, the largest batch of ``--batches`` that fits (eager; the compiled
model then runs the same batch), one training step as ``scripts/train.py`` takes it (diffusion
loss plus the load-balance loss, bf16 autocast, fused AdamW on CUDA, the foreach EMA update),
eager and compiled per block; ms/step, images/s and MFU (3 x forward
FLOPs on the dense-masked path against the device's datasheet peak). ``sample``: MoH-DiT-XL/2-90 at
256 px (32 x 32 latents, no VAE decode), DDPM with learned variance and guidance, eager and
compiled; images/s and what 50K images take at that rate. ``forward``: one forward of each
model at its trained head ratio (bf16 weights), eager and compiled, median of interleaved
calls. Weights are random: speed does not depend on them. Each row is written as soon as it
is measured, so a step stopped by a time limit leaves the rows it finished.
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time

import torch

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.diffusion import create_diffusion
from moh_dit.models import forward_flops
from moh_dit.outputs import atomic_write, write_json
from moh_dit.training import compile_model, update_ema
from moh_dit.training.trainer import GPU_PEAK_TFLOPS

from common import interleaved_medians, pick_device, randomize_weights_, sync

FULL = dict(models=("DiT-XL/2", "MoH-DiT-XL/2-90", "MoH-DiT-XL/2-75"), batches=(256, 128, 64, 32),
            train_steps=8, sample_model="MoH-DiT-XL/2-90", sample_batch=64, sample_steps=250, forward_batch=32,
            forward_repeats=15)
TINY = dict(models=("DiT-Tiny", "MoH-DiT-Tiny"), batches=(8, 4), train_steps=2, sample_model="MoH-DiT-Tiny",
            sample_batch=2, sample_steps=3, forward_batch=2, forward_repeats=2)
SECTIONS = ("train", "sample", "forward")


def _model(name: str, device: torch.device, tiny: bool) -> MoHDiTTransformer2DModel:
    overrides = dict(sample_size=8) if tiny else {}
    torch.manual_seed(0)
    return randomize_weights_(MoHDiTTransformer2DModel.from_preset(name, **overrides)).to(device)


def peak_flops(device: torch.device) -> tuple[float, str]:
    """(bf16 peak FLOP/s, where it came from): a known GPU's datasheet figure, else a timed matmul."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAK_TFLOPS.items():
            if key in name:
                return peaks[0] * 1e12, f"datasheet bf16 peak of {name}: {peaks[0]:g} TFLOP/s"
    a = torch.randn(1024, 1024, device=device)
    torch.mm(a, a)
    sync(device)
    start = time.perf_counter()
    torch.mm(a, a)
    sync(device)
    measured = 2 * 1024**3 / (time.perf_counter() - start)
    return measured, f"measured fp32 matmul on {device.type}: {measured / 1e9:.3g} GFLOP/s"


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


class _Trainer:
    """One model's training step (scripts/train.py's arithmetic, without its data loading)."""

    def __init__(self, model, device: torch.device, autocast: bool):
        self.model, self.device, self.autocast = model.train(), device, autocast
        self.ema = copy.deepcopy(model).requires_grad_(False).eval()
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        self.diffusion = create_diffusion()

    def step(self, batch: int) -> None:
        cfg = self.model.config
        x = torch.randn(batch, cfg.in_channels, cfg.sample_size, cfg.sample_size, device=self.device)
        y = torch.randint(0, cfg.num_classes, (batch,), device=self.device)
        t = self.diffusion.sample_timesteps(batch, device=self.device)
        noise = torch.randn_like(x)
        x_t = self.diffusion.q_sample(x, t, noise)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(x_t, t, y, output_load_balance_loss=True)
        loss = self.diffusion.training_losses(out.sample, x, x_t, t, noise)["loss"].mean() + 0.01 * out.load_balance_loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        update_ema(self.ema, self.model, 0.9999)

    def seconds_per_step(self, batch: int, steps: int, warmup: int) -> float:
        for _ in range(warmup):
            self.step(batch)
        sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step(batch)
        sync(self.device)
        return (time.perf_counter() - start) / steps


def _largest_batch(name: str, batches, device, tiny: bool, autocast: bool) -> int | None:
    for batch in batches:
        trainer = _Trainer(_model(name, device, tiny), device, autocast)
        try:
            trainer.seconds_per_step(batch, 1, 1)
            return batch
        except RuntimeError as error:
            if not _is_oom(error):
                raise
        finally:
            del trainer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return None


def train_rows(sizes: dict, device: torch.device, tiny: bool, emit, modes=(False, True)) -> None:
    autocast = device.type == "cuda"
    peak, source = peak_flops(device)
    for name in sizes["models"]:
        batch = _largest_batch(name, sizes["batches"], device, tiny, autocast)
        if batch is None:
            emit({"model": name, "error": f"no batch of {list(sizes['batches'])} fits"})
            continue
        for compiled in modes:
            model = _model(name, device, tiny)
            flops = 3 * forward_flops(model, ratio=1.0)  # backward = two forwards
            if compiled:
                compile_model(model, per_block=True)
            trainer = _Trainer(model, device, autocast)
            start = time.perf_counter()
            seconds = trainer.seconds_per_step(batch, sizes["train_steps"], warmup=3 if compiled else 2)
            images = batch / seconds
            emit({"model": name, "compiled": compiled, "batch": batch, "precision": "bf16 autocast" if autocast else
                  "fp32", "ms_per_step": 1e3 * seconds, "images_per_sec": images, "mfu": images * flops / peak,
                  "peak_source": source, "wall_s": time.perf_counter() - start})
            del trainer, model
            if device.type == "cuda":
                torch.cuda.empty_cache()


def sample_rows(sizes: dict, device: torch.device, tiny: bool, emit, modes=(False, True)) -> None:
    from moh_dit import MoHDiTPipeline
    from moh_dit.pipelines.pipeline_moh_dit import make_scheduler

    model = _model(sizes["sample_model"], device, tiny).eval()
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    from diffusers import AutoencoderKL

    # A tiny VAE the latent output never runs: the pipeline wants one for a latent model.
    vae = AutoencoderKL(block_out_channels=[4, 4, 4, 4], norm_num_groups=4, layers_per_block=1,
                        latent_channels=model.config.in_channels, down_block_types=["DownEncoderBlock2D"] * 4,
                        up_block_types=["UpDecoderBlock2D"] * 4).to(device)
    pipe = MoHDiTPipeline(transformer=model, scheduler=make_scheduler("ddpm"), vae=vae)
    pipe.set_progress_bar_config(disable=True)
    batch, steps = sizes["sample_batch"], sizes["sample_steps"]
    kwargs = dict(class_labels=list(range(batch)), guidance_scale=1.5, guidance_channels="dit",
                  seeds=list(range(batch)), output_type="latent")
    for compiled in modes:
        if compiled:
            compile_model(pipe.transformer, dynamic=None)
            pipe(num_inference_steps=2, **kwargs)  # compiles (the timed call then runs compiled)
        sync(device)
        start = time.perf_counter()
        pipe(num_inference_steps=steps, **kwargs)
        sync(device)
        seconds = time.perf_counter() - start
        images = batch / seconds
        emit({"model": sizes["sample_model"], "compiled": compiled, "batch": batch, "steps": steps, "guidance": 1.5,
              "dtype": str(pipe.transformer.dtype).removeprefix("torch."), "seconds_per_batch": seconds,
              "images_per_sec": images, "hours_for_50k_at_this_rate": 50_000 / images / 3600})


def forward_rows(sizes: dict, device: torch.device, tiny: bool, emit, modes=(False, True)) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = sizes["forward_batch"]
    for compiled in modes:
        models = {name: _model(name, device, tiny).to(dtype).eval() for name in sizes["models"][:2]}
        cfg = next(iter(models.values())).config
        x = torch.randn(batch, cfg.in_channels, cfg.sample_size, cfg.sample_size, device=device, dtype=dtype)
        t = torch.randint(0, 1000, (batch,), device=device)
        y = torch.randint(0, cfg.num_classes, (batch,), device=device)
        for model in models.values():
            model.set_sparse_inference(False)  # dense-masked: what a GPU runs (and what compiles)
            if compiled:
                compile_model(model)
        fns = {name: (lambda m=m: m(x, t, y)) for name, m in models.items()}
        with torch.no_grad():
            medians = interleaved_medians(fns, sizes["forward_repeats"], device, warmup=3 if compiled else 1)
        dense, moh = (medians[name] for name in sizes["models"][:2])
        emit({"compiled": compiled, "batch": batch, "dtype": str(dtype).removeprefix("torch."),
              **{f"{name} ms": 1e3 * s for name, s in medians.items()}, "moh_over_dense": moh / dense})


def _markdown(section: str, rows: list[dict]) -> str:
    if not rows:
        return f"## {section}\n\n(no rows)\n"
    keys = list(dict.fromkeys(k for row in rows for k in row))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = [f"## {section}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=SECTIONS)
    parser.add_argument("--tiny", action="store_true", help="toy sizes (a CPU smoke test of the same code)")
    parser.add_argument("--no-compile", action="store_true", help="eager rows only")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--json", default=None, help="write the rows and the machine here")
    parser.add_argument("--markdown", default=None, help="write the rows as a markdown table here")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    if not args.tiny and device.type != "cuda":
        raise ValueError("the full-size report needs a CUDA device (DiT-XL/2 at batch 256); use --tiny on the CPU.")
    sizes = TINY if args.tiny else FULL
    machine = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "tiny": args.tiny}
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        if args.json:
            write_json(args.json, {"machine": machine, "section": args.section, "rows": rows})
        if args.markdown:
            with atomic_write(args.markdown, "w") as f:
                f.write(_markdown(f"{args.section} ({machine['device']}, torch {machine['torch']})", rows))

    {"train": train_rows, "sample": sample_rows, "forward": forward_rows}[args.section](
        sizes, device, args.tiny, emit, (False,) if args.no_compile else (False, True))
    print(_markdown(args.section, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
