"""The GPU report's scripts in benchmarks/ start and run on a CPU at toy sizes (the tools
themselves are developer tools, measured on a GPU)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# Developer tools run end to end in subprocesses: many seconds each.
pytestmark = pytest.mark.slow


def run_tool(name: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python benchmarks/NAME.py ARGS`` started from ``cwd`` (not the repository root, so that
    only the installed package can answer ``import moh_dit``)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def finite_positive(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


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
