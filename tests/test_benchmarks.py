"""The GPU report's scripts in benchmarks/ start and run on a CPU (the measurements themselves
need a GPU): gpu_report.sh's steps with a recording `timeout`, speed_report.py at toy sizes."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
pytestmark = pytest.mark.slow  # subprocesses, many seconds each


def test_gpu_report_runs_every_step_from_any_folder(tmp_path):
    """Every step runs under its time limit with an existing script, writes to OUT_DIR, and the
    temporary training data is removed."""
    calls, fake, elsewhere = tmp_path / "calls.txt", tmp_path / "bin", tmp_path / "elsewhere"
    fake.mkdir()
    elsewhere.mkdir()
    (fake / "timeout").write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')  # records instead of running
    (fake / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'name, driver_version'\n")
    for tool in fake.iterdir():
        tool.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH="",
               TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu_report.sh"), "report"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    steps = [line.split() for line in calls.read_text().splitlines()]
    assert sum(int(words[0]) for words in steps) <= 480  # the report fits in 8 minutes
    for words in steps:
        script = words[-1] if words[2] == "-m" else words[2]  # "-m pytest ... FILE" or "SCRIPT ARGS"
        assert Path(script).is_file(), words
        assert all(Path(w).parent == elsewhere / "report" for w in words if w.endswith(".json")), words
    assert (elsewhere / "report" / "gpu_report.log").read_text().count(": exit 0 after") == len(steps)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp.")]


@pytest.mark.parametrize("section", ["train", "sample", "forward"])
def test_speed_report_sections_run_at_toy_sizes(tmp_path, section):
    done = subprocess.run([sys.executable, BENCHMARKS / "speed_report.py", section, "--tiny", "--no-compile",
                           "--device", "cpu", "--json", tmp_path / "r.json", "--markdown", tmp_path / "r.md"],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["section"] == section and report["rows"]
    for row in report["rows"]:
        speeds = [v for k, v in row.items() if k.endswith(("ms", "_sec", "ms_per_step", "moh_over_dense"))]
        assert speeds and all(math.isfinite(v) and v > 0 for v in speeds), row
    assert (tmp_path / "r.md").read_text().startswith(f"## {section} (")
