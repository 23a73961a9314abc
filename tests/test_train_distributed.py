"""Two real processes (torchrun, gloo on the CPU): a run killed with SIGKILL after a checkpoint
resumes to exactly the weights of an uninterrupted two-process run, and while it runs its folder
lock turns a second launch away."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
PAUSING = ROOT / "tests" / "train_pausing.py"
TIMEOUT = 150  # seconds; a launch takes ~25 s on two loaded CPU cores


def _launch(out, data, *extra, pause=0, pids=None, **kwargs):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               MOH_DIT_TEST_PAUSE_AFTER=str(pause), MOH_DIT_TEST_PID_DIR=str(pids or ""))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(PAUSING),
               "--preset", "MoH-DiT-Tiny", "--data-dir", str(data), "--vae", "none", "--image-size", "8",
               "--output-dir", str(out), "--max-steps", "4", "--global-batch-size", "4", "--checkpoint-every", "2",
               "--num-workers", "0", "--report-to", "none", "--log-every", "1", "--ema-decay", "0.9",
               *map(str, extra)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def _tree(root: Path):
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.slow
def test_two_processes_killed_run_resumes_exactly_and_holds_its_folder(tmp_path):
    rng = np.random.default_rng(0)
    for c, name in enumerate(("blue", "green", "red")):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(4):
            arr = rng.integers(0, 60, (8, 8, 3), dtype=np.uint8)
            arr[..., c] += 180
            Image.fromarray(arr).save(tmp_path / "data" / name / f"{i}.png")
    data, whole, killed, pids = tmp_path / "data", tmp_path / "whole", tmp_path / "killed", tmp_path / "pids"
    pids.mkdir()
    reference = _launch(whole, data)
    victim = _launch(killed, data, pause=2, pids=pids, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (killed / "checkpoints" / "step-0000002").is_dir():
            assert victim.poll() is None and time.monotonic() < deadline, "no step-2 checkpoint in time"
            time.sleep(0.2)
        time.sleep(1.0)  # let every process reach the pause
        before = _tree(killed)
        intruder = _launch(killed, data, "--resume", "latest")
        out, _ = intruder.communicate(timeout=TIMEOUT)
        assert intruder.returncode != 0 and str(killed) in out and "being written by moh-dit train" in out, out[-3000:]
        assert victim.poll() is None and _tree(killed) == before, "the busy run was disturbed"
    finally:  # SIGKILL mid-run: the launcher, then both workers (no handler, no cleanup runs)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        for rank in pids.iterdir():
            try:
                os.kill(int(rank.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not (killed / "checkpoints" / "step-0000004").exists()
    time.sleep(1.0)  # the killed workers are reaped
    resumed = _launch(killed, data, "--resume", "latest")
    out, _ = resumed.communicate(timeout=TIMEOUT)
    assert resumed.returncode == 0 and "Resumed from" in out, out[-3000:]
    out, _ = reference.communicate(timeout=TIMEOUT)
    assert reference.returncode == 0, out[-3000:]

    assert json.loads((killed / "train_config.json").read_text())["num_processes"] == 2
    for name in ("final/transformer/diffusion_pytorch_model.safetensors", "checkpoints/step-0000004/model.safetensors",
                 "checkpoints/step-0000004/ema.safetensors"):
        a, b = load_file(whole / name), load_file(killed / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
    for name in ("optimizer.safetensors", "train_state.json", "random_states_0.safetensors",
                 "random_states_1.safetensors"):
        assert (whole / "checkpoints/step-0000004" / name).read_bytes() == \
            (killed / "checkpoints/step-0000004" / name).read_bytes(), name
    assert [json.loads(line)["step"] for line in (killed / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
