"""Forward (or training-step) time of MoH-DiT vs diffusers' DiTTransformer2DModel of the
same size, in one run.

    python benchmarks/benchmark_model.py --size S --batch-size 4 --repeats 7
    python benchmarks/benchmark_model.py --size XL --batch-size 32 --train --autocast bf16   # on a GPU

``--train`` times one optimisation step per call (forward in train mode, MSE on the
output plus, for MoH, 0.01 x the load-balance loss as in training, backward, AdamW step),
with float32 master weights and optional autocast, as ``scripts/train.py --mixed-precision``
does. MoH layers train dense-masked (the routers need their gradients).

``--cuda-graph`` (CUDA only) adds each forward captured once in a CUDA graph and replayed,
which removes Python and launch overhead; those rows are compared with diffusers' DiT
replayed the same way.

Timings are interleaved (one call of each model per round) and the median is reported,
as ratios to diffusers' DiT, because a shared machine's speed drifts between runs.
Weights are random (the speed does not depend on them); routers are random too, so
routed heads are picked roughly uniformly.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import torch

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.utils.cli import run_cli
from moh_dit.utils.io import write_json_atomic
from moh_dit.models.presets import PRESETS

from common import diffusers_dit, interleaved_times, pick_device, randomize_weights_


def run(
    size: str = "S", batch_size: int = 4, repeats: int = 7, device: str | None = None, dtype: str = "float32",
    train: bool = False, autocast: str | None = None, cuda_graph: bool = False, head_sparse: bool = True,
) -> dict:
    dev = pick_device(device)
    dt = getattr(torch, dtype)
    if train and dt != torch.float32:
        raise ValueError("--train keeps float32 master weights; use --autocast bf16|fp16 for mixed precision.")
    if autocast and not train:
        raise ValueError("--autocast applies to --train; for forwards pick the weights' --dtype.")
    if cuda_graph and (train or dev.type != "cuda"):
        raise ValueError("--cuda-graph times forwards on a CUDA device; drop --train / use --device cuda.")
    torch.manual_seed(0)
    models = {f"diffusers DiT-{size}/2": diffusers_dit(f"DiT-{size}/2"), f"moh-dit DiT-{size}/2": None}
    models[f"moh-dit DiT-{size}/2"] = MoHDiTTransformer2DModel.from_preset(f"DiT-{size}/2")
    for suffix in ("90", "75"):
        name = f"MoH-DiT-{size}/2-{suffix}"
        models[name] = MoHDiTTransformer2DModel.from_preset(name)
        if not train and not head_sparse:
            models[name].set_sparse_inference(False)
            models[name + " (dense-masked)"] = models.pop(name)
        elif not train:
            dense = MoHDiTTransformer2DModel.from_preset(name)
            dense.load_state_dict(models[name].state_dict())
            dense.set_sparse_inference(False)
            models[name + " (dense-masked)"] = dense
            models[name].set_sparse_inference(True)
            models[name + " (head-sparse)"] = models.pop(name)
    for m in models.values():
        randomize_weights_(m).to(dev).train(train)
        if dt != torch.float32:
            m.to(dt)
    cfg = PRESETS[f"DiT-{size}/2"]
    x = torch.randn(batch_size, cfg["in_channels"], cfg["sample_size"], cfg["sample_size"], device=dev, dtype=dt)
    t = torch.randint(0, 1000, (batch_size,), device=dev)
    y = torch.randint(0, cfg["num_classes"], (batch_size,), device=dev)
    target = torch.randn(batch_size, 2 * cfg["in_channels"], cfg["sample_size"], cfg["sample_size"], device=dev)
    calls = {name: _train_step(m, x, t, y, target, autocast) if train else _forward(m, x, t, y) for name, m in models.items()}
    if cuda_graph:  # each forward without the head-sparse path (host syncs) captured once and replayed
        for name in [n for n in calls if "head-sparse" not in n]:
            calls[name + " (CUDA graph)"] = _graphed(models[name], x, t, y)
            models[name + " (CUDA graph)"] = models[name]
    with torch.inference_mode(not train):  # warm-up twice: AdamW allocates its state on the first step
        times = interleaved_times(calls, repeats, dev, warmup=2, alternate=False)
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        act = getattr(models[name], "head_activation_ratio", 1.0)
        # CUDA-graph rows against diffusers' graph row, eager rows against its eager one
        base = statistics.median(times[f"diffusers DiT-{size}/2" + (" (CUDA graph)" if name.endswith("(CUDA graph)") else "")])
        rows.append(dict(model=name, median_ms=med * 1e3, ratio_to_diffusers=med / base, head_activation=act))
    return dict(
        rows=rows, size=size, batch_size=batch_size, repeats=repeats, device=str(dev), dtype=dtype,
        mode="train step" if train else "forward", autocast=autocast,
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)" + (f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else ""),
    )


def _forward(model, x, t, y):
    return lambda: model(x, t, y)


def _graphed(model, x, t, y):
    """The model's forward captured in a CUDA graph (static inputs); replaying it launches
    every kernel at once, so the time is the GPU's, without Python and launch overhead."""
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the default stream, as capture requires
            for _ in range(2):
                model(x, t, y)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(x, t, y)
    return graph.replay


def _train_step(model, x, t, y, target, autocast: str | None):
    """One AdamW step on an MSE loss (plus 0.01 x the load-balance loss for MoH)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    moh = isinstance(model, MoHDiTTransformer2DModel) and model.is_moh
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(autocast)

    def step():
        with torch.autocast(x.device.type, dtype=amp, enabled=amp is not None):
            if moh:
                out = model(x, t, y, output_load_balance_loss=True)
                loss = (out.sample.float() - target).pow(2).mean() + 0.01 * out.load_balance_loss
            else:
                loss = (model(x, t, y).sample.float() - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["S", "B", "L", "XL"], default="S")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--train", action="store_true", help="time training steps instead of forwards")
    parser.add_argument("--autocast", default=None, choices=["bf16", "fp16"], help="mixed precision for --train")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="also time each forward (head-sparse excepted) replayed from a CUDA graph")
    parser.add_argument("--no-head-sparse", action="store_true", help="leave out the head-sparse MoH variants")
    parser.add_argument("--json", default=None, help="also write the table as JSON here")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    result = run(args.size, args.batch_size, args.repeats, args.device, args.dtype, args.train, args.autocast,
                 args.cuda_graph, not args.no_head_sparse)
    print(f"{result['machine']} | {result['device']} {result['dtype']} | {result['mode']}"
          f"{', autocast ' + args.autocast if args.autocast else ''} | batch {result['batch_size']}, 32x32x4 latents, "
          f"median of {result['repeats']} interleaved runs")
    print(f"{'model':<40} {'ms':>9} {'vs diffusers':>13} {'heads on':>9}")
    for r in result["rows"]:
        print(f"{r['model']:<40} {r['median_ms']:>9.1f} {r['ratio_to_diffusers']:>12.3f}x {r['head_activation']:>9.4f}")
    if args.json:
        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, parse_args))
