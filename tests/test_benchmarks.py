"""The developer tools in benchmarks/, run from their own folder at toy sizes."""

import importlib.util
import json
import math
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moh_dit import MoHDiTTransformer2DModel
from moh_dit.utils.cli import run_cli
from reference_attention import ideal_flop_ratio

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# Developer tools run end to end in subprocesses: many seconds each.
pytestmark = pytest.mark.slow


@pytest.fixture
def load_tool(monkeypatch):
    """``load_tool("benchmark_model")`` imports ``benchmarks/benchmark_model.py`` as a module, with
    its folder on ``sys.path`` as ``python benchmarks/benchmark_model.py`` has it (the tools
    import their sibling ``common``)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"moh_dit_benchmark_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


def run_tool(name: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python benchmarks/NAME.py ARGS`` started from ``cwd`` (not the repository root, so that
    only the installed package can answer ``import moh_dit``)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def finite_positive(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def test_benchmark_script_layer_rows_smoke(load_tool, one_thread):
    """The benchmark's layer part runs (tiny: one repeat, 64 tokens) and its rows add up."""
    bench = load_tool("benchmark_attention")
    rows = bench.layer_rows("B", 64, 1, [1.0, 0.5], 0, 1, torch.device("cpu"), torch.float32)
    assert [(r["top_k"], r["realised_ratio"]) for r in rows] == [(12, 1.0), (6, 0.5)]
    assert rows[1]["ideal_flop_ratio"] == pytest.approx(ideal_flop_ratio(64, 768, 768, 0.5))
    assert all(r["dense_ms"] > 0 and r["sparse_ms"] > 0 for r in rows)
    assert set(bench.check_targets(rows)) == {"sparse r=1.0: <= 1.05 x dense", "dense-masked: <= 1.10 x dense"}


def test_benchmark_attention_refuses_a_ratio_without_heads(load_tool):
    """A ratio below the always-on shared heads is refused before timing; K = 0 routed heads
    beside a shared head is a valid layer."""
    bench = load_tool("benchmark_attention")
    with pytest.raises(ValueError, match="leaves no valid top-K"):
        bench.layer_rows("B", 16, 1, [0.01], 2, 1, torch.device("cpu"), torch.float32)
    rows = bench.layer_rows("B", 16, 1, [0.01], 1, 1, torch.device("cpu"), torch.float32)  # K = 0 beside a shared head
    assert (rows[0]["shared_heads"], rows[0]["top_k"]) == (1, 0)


def test_benchmark_attention_cli_writes_its_tables(tmp_path):
    """``--quick --no-model`` from another folder: the JSON holds the quick layer rows with finite
    timings and the targets that apply to them."""
    out = tmp_path / "attention.json"
    done = run_tool("benchmark_attention", ["--quick", "--no-model", "--threads", "1", "--json", str(out), "--markdown"],
                    tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["command"].startswith("python benchmarks/benchmark_attention.py --quick")
    assert (result["device"], result["dtype"], result["repeats"], result["model"]) == ("cpu", "float32", 2, [])
    layers = result["layers"]
    assert [(r["width"], r["tokens"], r["batch"], r["ratio"], r["top_k"]) for r in layers] == [
        ("B", 256, 1, 1.0, 12), ("B", 256, 1, 0.5, 6)]
    for r in layers:
        assert finite_positive(r["dense_ms"], r["masked_ms"], r["sparse_ms"], r["masked_over_dense"], r["sparse_over_dense"])
        assert r["ideal_flop_ratio"] == pytest.approx(ideal_flop_ratio(256, 768, 768, r["realised_ratio"]))
        assert r["sparse_over_ideal"] == pytest.approx(r["sparse_over_dense"] / r["ideal_flop_ratio"])
    assert layers[0]["sparse_path"] == "dense (all selected)" and layers[1]["sparse_path"] == "skip"
    assert set(result["targets"]) == {"sparse r=1.0: <= 1.05 x dense", "dense-masked: <= 1.10 x dense"}
    assert "| B (768 = 12 x 64) | 256 | 1 | 0.50 | 6/12 |" in done.stdout  # the markdown table


def test_benchmark_attention_model_flops(load_tool):
    """The whole-model ideal FLOP ratios of the measured table (attention at the active
    fraction of each layer plus the MLP, against dense DiT-B/2)."""
    bench = load_tool("benchmark_attention")

    def layout(name: str) -> MoHDiTTransformer2DModel:
        with torch.device("meta"):  # only the configuration and the layer layout are read
            return MoHDiTTransformer2DModel.from_preset(name)

    dense = bench.model_flops(layout("DiT-B/2"), sparse=False)
    assert dense == 45902462976.0  # 12 x (attention 2 N D (4 D) + 4 N^2 D, MLP 2 N D (4 D) 2), N = 256, D = 768
    expected = {"MoH-DiT-B/2-75": {None: 0.947, 0.65: 0.927, 0.6: 0.915}, "MoH-DiT-B/2-90": {None: 0.978, 0.75: 0.947}}
    for name, ratios in expected.items():
        moh = layout(name)
        for ratio, ideal in ratios.items():
            moh.set_head_activation_ratio(ratio)
            assert bench.model_flops(moh, sparse=True) / dense == pytest.approx(ideal, abs=5e-4), (name, ratio)
            assert bench.model_flops(moh, sparse=False) == dense  # dense-masked computes every head


def test_benchmark_model_cli_writes_its_table(load_tool, one_thread, tmp_path, capsys):
    """DiT-S/2 forwards at batch 1: every variant timed, ratios against diffusers' DiT."""
    bench = load_tool("benchmark_model")
    out = tmp_path / "model.json"
    assert run_cli(bench.main, bench.parse_args, ["--size", "S", "--batch-size", "1", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["size"], result["batch_size"], result["mode"], result["device"]) == ("S", 1, "forward", "cpu")
    rows = {r["model"]: r for r in result["rows"]}
    assert list(rows) == ["diffusers DiT-S/2", "moh-dit DiT-S/2", "MoH-DiT-S/2-90 (dense-masked)",
                          "MoH-DiT-S/2-90 (head-sparse)", "MoH-DiT-S/2-75 (dense-masked)", "MoH-DiT-S/2-75 (head-sparse)"]
    assert rows["diffusers DiT-S/2"]["ratio_to_diffusers"] == 1.0
    assert all(finite_positive(r["median_ms"], r["ratio_to_diffusers"]) for r in rows.values())
    assert rows["MoH-DiT-S/2-75 (head-sparse)"]["head_activation"] == 0.75
    assert rows["MoH-DiT-S/2-90 (dense-masked)"]["head_activation"] == pytest.approx(0.8889, abs=1e-4)
    assert "MoH-DiT-S/2-75 (head-sparse)" in capsys.readouterr().out


def test_benchmark_model_refuses_contradicting_flags(load_tool, capsys):
    """Flags that contradict each other are one error line, exit status 1."""
    bench = load_tool("benchmark_model")
    for argv in (["--autocast", "bf16"], ["--train", "--dtype", "bfloat16"], ["--cuda-graph", "--device", "cpu"]):
        assert run_cli(bench.main, bench.parse_args, argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err, (argv, err)


def test_benchmark_data_measures_both_paths(load_tool, one_thread, capsys):
    """Two 32 px images: both the on-the-fly encoding and the latent cache are timed."""
    bench = load_tool("benchmark_data")
    argv = ["--num-images", "2", "--image-size", "32", "--batch-size", "2", "--device", "cpu"]
    assert run_cli(bench.main, bench.parse_args, argv) == 0
    assert re.fullmatch(r"cpu, 32px: on the fly \(crop \+ SD-VAE encode\) [0-9.]+ images/s; latent cache [0-9]+ samples/s "
                        r"\([0-9]+x\)\n", capsys.readouterr().out)
    result = bench.run(2, 32, 2, "cpu")
    assert finite_positive(result["on_the_fly_images_per_s"], result["cache_samples_per_s"], result["speedup"])
    assert result["speedup"] == pytest.approx(result["cache_samples_per_s"] / result["on_the_fly_images_per_s"])


def test_compare_diffusers_dit(load_tool, one_thread, capsys):
    """The conversion's differences from diffusers' forward are measured, printed and small; a MoH
    preset (diffusers has no MoH model) is refused."""
    compare = load_tool("compare_diffusers_dit")
    assert run_cli(compare.main, compare.parse_args, ["--preset", "DiT-S/2", "--batch-size", "2"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header == "DiT-S/2, random N(0, 0.02) weights, t = 0..999"
    result = {key: float(value) for key, value in (line.split() for line in lines)}
    assert list(result) == ["timestep_embedding_max_abs_diff", "output_max_abs_diff", "output_relative_l2_diff"]
    assert finite_positive(*result.values())
    assert result["output_relative_l2_diff"] < 0.1
    with pytest.raises(ValueError, match="MoH preset"):
        compare.compare("MoH-DiT-S/2-75")


def _fake_bin(folder: Path, timeout_script: str) -> Path:
    """A ``timeout`` that records its command instead of running it, and an ``nvidia-smi``."""
    folder.mkdir()
    (folder / "timeout").write_text(timeout_script)
    (folder / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'name, driver_version'\n")
    for tool in folder.iterdir():
        tool.chmod(0o755)
    return folder


def test_gpu_report_runs_every_step_from_any_folder(tmp_path):
    """From an unrelated folder with a relative OUT_DIR: every step runs under its time limit,
    its script path exists, its results go to OUT_DIR, and the temporary training data is removed."""
    calls = tmp_path / "calls.txt"
    fake = _fake_bin(tmp_path / "bin", f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PATH=f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH="", TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu_report.sh"), "report"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = elsewhere / "report"
    steps = calls.read_text().splitlines()
    limits = [int(line.split()[0]) for line in steps]
    assert limits == [80, 200, 120, 60] and sum(limits) <= 480  # the report fits in 8 minutes
    assert [line.split()[3] for line in steps[1:]] == ["train", "sample", "forward"]
    for line in steps:
        words = line.split()
        assert words[1] == "python3"
        script = words[-1] if words[2] == "-m" else words[2]  # "-m pytest ... FILE" or "SCRIPT ARGS"
        assert Path(script).is_absolute() and Path(script).is_file(), line
        for word in words:
            if word.endswith(".json"):
                assert Path(word).parent == out, line
    log = (out / "gpu_report.log").read_text()
    assert log.count(": exit 0 after") == 4 and "name, driver_version" in log
    report = (out / "speed_report.md").read_text()  # the fake steps wrote no rows: each section says so
    assert report.startswith("# Speed report") and report.count("no rows (see gpu_report.log)") == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp.")]  # the training data is gone


def test_gpu_report_needs_the_installed_package(tmp_path):
    """Without an importable moh-dit it stops before any step, naming the install command."""
    fake = _fake_bin(tmp_path / "bin", "#!/usr/bin/env bash\nexit 99\n")
    (fake / "python3").write_text("#!/usr/bin/env bash\nexit 1\n")
    (fake / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}")
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu_report.sh"), str(tmp_path / "report")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "pip install -e" in done.stderr
    assert not (tmp_path / "report" / "gpu_report.log").exists()


@pytest.mark.parametrize("section", ["train", "sample", "forward"])
def test_speed_report_sections_run_at_toy_sizes(tmp_path, section):
    """benchmarks/speed_report.py's CPU path (the code the GPU report runs, at toy sizes and
    eager: tests/test_compile.py covers compiled models): rows with positive speeds, JSON and
    markdown written."""
    done = run_tool("speed_report", [section, "--tiny", "--no-compile", "--device", "cpu", "--json",
                                     str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")], tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    rows = report["rows"]
    assert report["section"] == section and rows and all(row.get("compiled") is False for row in rows)
    if section == "train":
        assert [r["model"] for r in rows] == ["DiT-Tiny", "MoH-DiT-Tiny"] and all(r["batch"] == 8 for r in rows)
        assert all(finite_positive(r["ms_per_step"], r["images_per_sec"], r["mfu"]) for r in rows)
    elif section == "sample":
        assert finite_positive(rows[0]["images_per_sec"], rows[0]["hours_for_50k_at_this_rate"])
    else:
        assert finite_positive(rows[0]["moh_over_dense"], rows[0]["DiT-Tiny ms"], rows[0]["MoH-DiT-Tiny ms"])
    assert (tmp_path / "r.md").read_text().startswith(f"## {section} (")


def test_speed_report_full_size_needs_a_gpu(tmp_path):
    done = run_tool("speed_report", ["train", "--device", "cpu"], tmp_path)
    assert done.returncode != 0 and "needs a CUDA device" in done.stderr and "--tiny" in done.stderr
