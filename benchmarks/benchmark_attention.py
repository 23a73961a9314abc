"""Time MoH attention against diffusers' dense attention: one layer, then a whole model.

    python benchmarks/benchmark_attention.py --json attention_benchmark.json
    python benchmarks/benchmark_attention.py --quick          # smoke run at toy sizes

Layer part: diffusers' ``Attention`` (``AttnProcessor2_0``, SDPA) against ``MoHAttention``
with the same projection weights, dense-masked (every head computed, unselected ones
zeroed) and head-sparse (``MoHSparseAttnProcessor``), at DiT-XL width (1152 = 16 x 72)
and DiT-B width (768 = 12 x 64). A MoH layer at activation ratio r has hs shared heads
(``--shared-heads``, default 0: all heads routed) and K = round(r h) - hs routed heads
per token; MoH times include routing. Beside each measured time ratio is the ideal FLOP
ratio (docs/design.md, section 4: Q and output projections and attention scale with r,
K and V do not).

Model part: a whole forward of MoH-DiT-B/2 presets (head-sparse at the trained ratio and
lower ones, dense-masked at the trained ratio) against the dense DiT-B/2 of this package.

All variants of one table run in the same process on the same inputs; timings are
interleaved (one call of each variant per round, order reversed every other round, so
drifting machine speed hits all alike) and the median is reported; on CUDA each call is
synchronized. Weights and routers are random: speed does not depend on their values, and
random routers pick heads roughly uniformly. On a CPU shared with other processes, use
``--threads 1``: with more threads every parallel region of the many small head-sparse
calls can wait for a core that another process holds.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Callable

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.utils import logging as diffusers_logging

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.utils.cli import run_cli
from moh_dit.models.flops import attention_flops
from moh_dit.utils.io import write_json_atomic
from moh_dit.models.presets import PRESETS
from moh_dit.models.attention import MoHAttention
from moh_dit.models.layout import min_top_k
from moh_dit.models.sparse_attention import MoHSparseAttnProcessor

from common import interleaved_medians, pick_device, randomize_weights_

WIDTHS = {"XL": (1152, 16, 72), "B": (768, 12, 64)}  # hidden, heads, head_dim
TARGETS = {"sparse_over_ideal_r05_N1024": 1.15, "sparse_r10": 1.05, "masked": 1.10}


def layer_rows(
    width: str, tokens: int, batch: int, ratios: list[float], shared: int, repeats: int,
    device: torch.device, dtype: torch.dtype, seed: int = 0,
) -> list[dict]:
    """Rows for one (width, tokens): dense, then MoH dense-masked and head-sparse per ratio."""
    dim, heads, head_dim = WIDTHS[width]
    torch.manual_seed(seed)
    dense = Attention(dim, heads=heads, dim_head=head_dim, bias=True, out_bias=True, processor=AttnProcessor2_0())
    dense = dense.to(device, dtype).eval()
    x = torch.randn(batch, tokens, dim, device=device, dtype=dtype)
    fns: dict[str, Callable[[], object]] = {"dense": lambda: dense(x)}
    layouts = {}
    for r in ratios:
        k = min(heads, max(1, round(r * heads))) - shared
        if k < min_top_k(heads, shared):
            raise ValueError(f"ratio {r} with --shared-heads {shared} leaves no valid top-K for {heads} heads.")
        moh = MoHAttention(dim, heads, head_dim, num_shared_heads=shared, top_k=k)
        moh.load_state_dict(dense.state_dict(), strict=False)  # same projections; random routers
        moh = moh.to(device, dtype).eval()
        layouts[r] = (k, (shared + k) / heads, moh.sparse_processor.skips_heads(moh))
        for mode, enabled in (("masked", False), ("sparse", True)):
            def call(moh=moh, enabled=enabled):
                moh.sparse_inference = enabled
                return moh(x)
            fns[f"{mode}@{r}"] = call
        if not layouts[r][2] and k < heads - shared:  # the default falls back to dense-masked here
            forced = MoHSparseAttnProcessor(dense_above=1.0)
            fns[f"forced@{r}"] = lambda moh=moh, forced=forced: forced(moh, x, moh.route(x))
    with torch.inference_mode():
        med = interleaved_medians(fns, repeats, device, warmup=3 if device.type == "cuda" else 1)
    rows = []
    for r in ratios:
        k, realised, skips = layouts[r]
        ideal = attention_flops(tokens, dim, heads * head_dim, realised) / attention_flops(tokens, dim, heads * head_dim)
        sparse = med[f"sparse@{r}"] / med["dense"]
        forced = med.get(f"forced@{r}")
        rows.append(dict(
            width=width, hidden=dim, heads=heads, head_dim=head_dim, tokens=tokens, batch=batch,
            ratio=r, shared_heads=shared, top_k=k, realised_ratio=realised,
            sparse_path="skip" if skips else ("dense (all selected)" if k == heads - shared else "dense (K/E > dense_above)"),
            dense_ms=med["dense"] * 1e3, masked_ms=med[f"masked@{r}"] * 1e3, sparse_ms=med[f"sparse@{r}"] * 1e3,
            masked_over_dense=med[f"masked@{r}"] / med["dense"], sparse_over_dense=sparse,
            forced_skip_over_dense=None if forced is None else forced / med["dense"],
            ideal_flop_ratio=ideal, sparse_over_ideal=sparse / ideal,
        ))
    return rows


def model_flops(model: MoHDiTTransformer2DModel, sparse: bool) -> float:
    """Per-image FLOPs of the blocks (attention with head-sparse ideal or dense, MLP)."""
    cfg = model.config
    tokens = (cfg.sample_size // cfg.patch_size) ** 2
    dim = cfg.hidden_size
    total = 0.0
    shared = model.layer_shared or model.layer_heads
    for h, hs, k in zip(model.layer_heads, shared, model.top_k_per_layer):
        active = (hs + k) / h if sparse else 1.0
        total += attention_flops(tokens, dim, h * cfg.attention_head_dim, active)
        total += 2 * tokens * dim * int(cfg.mlp_ratio * dim) * 2
    return total


def model_rows(
    batch: int, repeats: int, device: torch.device, dtype: torch.dtype, quick: bool, seed: int = 0,
) -> list[dict]:
    """Whole forward of MoH-DiT-B/2 presets at the trained and lower ratios vs dense DiT-B/2."""
    plans = {"MoH-DiT-B/2-75": [None, 0.65, 0.6], "MoH-DiT-B/2-90": [None, 0.75]}
    if quick:
        plans = {"MoH-DiT-B/2-75": [None, 0.6]}

    def build(name: str) -> MoHDiTTransformer2DModel:
        torch.manual_seed(seed)
        model = randomize_weights_(MoHDiTTransformer2DModel.from_preset(name))
        return model.to(device=device, dtype=dtype).eval()

    dense = build("DiT-B/2")
    cfg = PRESETS["DiT-B/2"]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg["in_channels"], cfg["sample_size"], cfg["sample_size"], generator=gen).to(device, dtype)
    t = torch.randint(0, 1000, (batch,), generator=gen).to(device)
    y = torch.randint(0, cfg["num_classes"], (batch,), generator=gen).to(device)
    fns: dict[str, Callable[[], object]] = {"DiT-B/2": lambda: dense(x, t, y)}
    info = {"DiT-B/2": dict(model="DiT-B/2", path="dense", ratio=1.0, trained=True, ideal_flop_ratio=1.0)}
    dense_flops = model_flops(dense, sparse=False)
    for name, ratios in plans.items():
        moh = build(name)
        for ratio in ratios:
            paths = ("dense-masked", "head-sparse") if ratio is None else ("head-sparse",)
            for path in paths:
                def call(moh=moh, ratio=ratio, sparse=path != "dense-masked"):
                    moh.set_head_activation_ratio(ratio)
                    moh.set_sparse_inference(sparse)
                    return moh(x, t, y)
                realised = moh.set_head_activation_ratio(ratio)
                ideal = model_flops(moh, sparse=path != "dense-masked") / dense_flops
                key = f"{name} {path} @{'trained' if ratio is None else ratio}"
                fns[key] = call
                info[key] = dict(model=name, path=path, ratio=realised, trained=ratio is None, ideal_flop_ratio=ideal)
    with torch.inference_mode():
        med = interleaved_medians(fns, repeats, device, warmup=3 if device.type == "cuda" else 1)
    base = med["DiT-B/2"]
    return [dict(**info[key], batch=batch, tokens=256, ms=med[key] * 1e3, over_dense=med[key] / base) for key in fns]


def machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {os.cpu_count()} CPUs ({torch.get_num_threads()} torch threads), torch {torch.__version__}"
    if device.type == "cuda":
        text += f", {torch.cuda.get_device_name(device)}"
    return text


def check_targets(layers: list[dict]) -> dict[str, dict]:
    """The head-sparse targets (docs/benchmarks.md), evaluated on the measured layer rows."""
    out = {}
    strict = [r for r in layers if r["ratio"] == 0.5 and r["tokens"] == 1024]
    if strict:
        worst = max(r["sparse_over_ideal"] for r in strict)
        out["sparse r=0.5, N=1024: time ratio <= 1.15 x ideal FLOP ratio"] = dict(worst=worst, ok=worst <= TARGETS["sparse_over_ideal_r05_N1024"])
    full = [r for r in layers if r["ratio"] == 1.0]
    if full:
        worst = max(r["sparse_over_dense"] for r in full)
        out["sparse r=1.0: <= 1.05 x dense"] = dict(worst=worst, ok=worst <= TARGETS["sparse_r10"])
    worst = max(r["masked_over_dense"] for r in layers)
    out["dense-masked: <= 1.10 x dense"] = dict(worst=worst, ok=worst <= TARGETS["masked"])
    return out


def markdown(result: dict) -> str:
    """The layer and model tables as markdown."""
    lines = [
        f"{result['machine']}; {result['device']} {result['dtype']}; median of {result['repeats']} interleaved rounds.",
        "",
        "| width | N | batch | ratio r | active heads | dense ms | MoH dense-masked | MoH head-sparse | ideal FLOP ratio | sparse / ideal | sparse path |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["layers"]:
        path = r["sparse_path"]
        if r["forced_skip_over_dense"] is not None:
            path += f"; skipping anyway {r['forced_skip_over_dense']:.3f}x"
        lines.append(
            f"| {r['width']} ({r['hidden']} = {r['heads']} x {r['head_dim']}) | {r['tokens']} | {r['batch']} | {r['ratio']:.2f} "
            f"| {r['shared_heads'] + r['top_k']}/{r['heads']} | {r['dense_ms']:.1f} | {r['masked_over_dense']:.3f}x "
            f"| {r['sparse_over_dense']:.3f}x | {r['ideal_flop_ratio']:.3f} | {r['sparse_over_ideal']:.3f} | {path} |"
        )
    if result["model"]:
        lines += ["", "| model (batch {}, 256 tokens) | path | head ratio | ms | vs dense DiT-B/2 | ideal FLOP ratio |".format(
            result["model"][0]["batch"]), "|---|---|---|---|---|---|"]
        for r in result["model"]:
            lines.append(f"| {r['model']} | {r['path']} | {r['ratio']:.3f} | {r['ms']:.1f} | {r['over_dense']:.3f}x | {r['ideal_flop_ratio']:.3f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--batch-size", type=int, default=None, help="layer batch; default 8 on CUDA, 4 on CPU")
    parser.add_argument("--model-batch-size", type=int, default=None, help="default 8 on CUDA, 2 on CPU")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--widths", nargs="+", choices=sorted(WIDTHS), default=["XL", "B"])
    parser.add_argument("--ratios", type=float, nargs="+", default=[1.0, 0.9, 0.75, 0.5])
    parser.add_argument("--shared-heads", type=int, default=0, help="always-on heads of the benchmark layer")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds; default 25 on CUDA, 7 on CPU")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-model", action="store_true", help="skip the whole-model part")
    parser.add_argument("--quick", action="store_true", help="smoke run: B width, 256 tokens, ratios 1.0 and 0.5, batch 1")
    parser.add_argument("--json", default=None, help="also write the tables as JSON here")
    parser.add_argument("--markdown", action="store_true", help="also print the tables as markdown (for the README)")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> dict:
    diffusers_logging.set_verbosity_error()  # ModelMixin.to(dtype) warns even for float32
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    batch = args.batch_size or (8 if cuda else 4)
    model_batch = args.model_batch_size or (8 if cuda else 2)
    repeats = args.repeats or (25 if cuda else 7)
    widths, tokens, ratios = args.widths, args.tokens, args.ratios
    if args.quick:
        widths, tokens, ratios = ["B"], [256], [1.0, 0.5]
        batch, model_batch, repeats = 1, 1, 2

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if device.type == "cpu" and load_before is not None and load_before > 0.5 * (os.cpu_count() or 1):
        print(f"warning: 1-minute load average is {load_before:.2f} on {os.cpu_count()} CPUs before the run; "
              "other processes share the cores, and with several torch threads every parallel region can "
              "wait for a busy core (small per-head calls suffer most). Numbers will be noisy.", file=sys.stderr)
    layers = []
    for width in widths:
        for n in tokens:
            layers += layer_rows(width, n, batch, ratios, args.shared_heads, repeats, device, dtype)
    models = [] if args.no_model else model_rows(model_batch, repeats, device, dtype, args.quick)
    result = dict(
        machine=machine(device), device=str(device), dtype=str(dtype).replace("torch.", ""), repeats=repeats,
        command="python benchmarks/benchmark_attention.py " + " ".join(sys.argv[1:]) if __name__ == "__main__" else None,
        load_average=dict(before=load_before, after=os.getloadavg()[0] if hasattr(os, "getloadavg") else None),
        layers=layers, model=models, targets=check_targets(layers),
    )

    print(f"{result['machine']} | {result['device']} {result['dtype']} | median of {repeats} interleaved rounds")
    print(f"\n{'width':<5} {'N':>5} {'B':>3} {'r':>5} {'hs+K/h':>8} {'dense ms':>9} {'masked':>8} {'sparse':>8} "
          f"{'ideal':>7} {'sp/ideal':>9}  sparse path")
    for r in layers:
        path = r["sparse_path"]
        if r["forced_skip_over_dense"] is not None:
            path += f"; skipping anyway: {r['forced_skip_over_dense']:.3f}x"
        print(f"{r['width']:<5} {r['tokens']:>5} {r['batch']:>3} {r['ratio']:>5.2f} "
              f"{r['shared_heads'] + r['top_k']:>3}/{r['heads']:<4} {r['dense_ms']:>9.2f} {r['masked_over_dense']:>7.3f}x "
              f"{r['sparse_over_dense']:>7.3f}x {r['ideal_flop_ratio']:>7.3f} {r['sparse_over_ideal']:>8.3f}x  {path}")
    if models:
        print(f"\n{'model (batch ' + str(model_batch) + ', 256 tokens)':<44} {'ratio':>6} {'ms':>9} {'vs dense':>9} {'ideal':>7}")
        for r in models:
            label = r["model"] if r["path"] == "dense" else f"{r['model']} {r['path']}"
            print(f"{label:<44} {r['ratio']:>6.3f} {r['ms']:>9.1f} {r['over_dense']:>8.3f}x {r['ideal_flop_ratio']:>7.3f}")
    print()
    for name, res in result["targets"].items():
        print(f"target {name}: worst {res['worst']:.3f} -> {'met' if res['ok'] else 'NOT met'}")
    if args.markdown:
        print("\n" + markdown(result))
    if args.json:
        write_json_atomic(args.json, result)
    return result


if __name__ == "__main__":
    sys.exit(run_cli(main, parse_args))
