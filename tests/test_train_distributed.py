"""Two real processes (torchrun, gloo on CPU) running scripts/train.py: a run killed with
SIGKILL after a checkpoint resumes to exactly the weights of an uninterrupted two-process
run, and while it runs its folder lock turns a second two-process launch away at once."""

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

from moh_dit.utils.output_folders import lock_path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
PAUSING = ROOT / "tests" / "train_pausing.py"
LAUNCH_TIMEOUT = 150  # seconds; a launch takes ~25 s on two loaded CPU cores


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("WORLD_SIZE", None)
    env.update(extra)
    return env


def _command(script, out, data, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
            "--preset", "MoH-DiT-Tiny", "--data-dir", str(data), "--vae", "none", "--image-size", "8",
            "--output-dir", str(out), "--max-steps", "4", "--global-batch-size", "4", "--checkpoint-every", "2",
            "--num-workers", "0", "--report-to", "none", "--log-every", "1", "--ema-decay", "0.9", *map(str, extra)]


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    for _ in range(100):  # an orphan is reaped by init; wait until it is gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def _tree(root: Path):
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.fixture
def images(tmp_path):
    rng = np.random.default_rng(0)
    for c, name in enumerate(("blue", "green", "red")):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(4):
            arr = rng.integers(0, 60, (8, 8, 3), dtype=np.uint8)
            arr[..., c] += 180
            Image.fromarray(arr).save(tmp_path / "data" / name / f"{i}.png")
    return tmp_path / "data"


@pytest.mark.slow
def test_two_processes_killed_run_resumes_exactly_and_holds_its_folder(tmp_path, images):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    # The uninterrupted reference and the run to be killed, side by side.
    reference = subprocess.Popen(_command(TRAIN, whole, images), env=_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    pids = tmp_path / "pids"
    pids.mkdir()
    victim = subprocess.Popen(_command(PAUSING, killed, images),
                              env=_env(MOH_DIT_TEST_PAUSE_AFTER="2", MOH_DIT_TEST_PID_DIR=str(pids)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not (killed / "checkpoints" / "step-0000002").is_dir():
            assert victim.poll() is None, "the run to be killed ended early"
            assert time.monotonic() < deadline, "no step-2 checkpoint in time"
            time.sleep(0.2)
        time.sleep(1.0)  # let it finish the save (verify, prune) and reach the pause

        # A second two-process launch into the busy folder: refused at once, on every rank.
        holder = json.loads(lock_path(killed).read_text())
        before = _tree(killed)
        started = time.monotonic()
        intruder = subprocess.run(_command(TRAIN, killed, images, "--resume", "latest"), env=_env(),
                                  capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
        assert intruder.returncode != 0
        assert f"--output-dir {killed} is being written by another command (moh-dit train" in intruder.stderr, \
            intruder.stderr[-3000:]
        assert f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}" in intruder.stderr
        assert time.monotonic() - started < LAUNCH_TIMEOUT / 2
        assert victim.poll() is None and _tree(killed) == before, "the busy run was disturbed"
        assert holder["pid"] == int((pids / "0").read_text())  # rank 0 holds the lock
    finally:
        # SIGKILL mid-run: the launcher, then both workers (no handler, no cleanup runs)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        for rank in pids.iterdir():
            _kill_and_reap(int(rank.read_text()))
    assert not (killed / "checkpoints" / "step-0000004").exists()

    resumed = subprocess.run(_command(TRAIN, killed, images, "--resume", "latest"), env=_env(),
                             capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from" in resumed.stdout + resumed.stderr
    out, _ = reference.communicate(timeout=LAUNCH_TIMEOUT)
    assert reference.returncode == 0, out[-3000:]

    record = json.loads((killed / "train_config.json").read_text())
    assert record["num_processes"] == 2
    for name in ("final/transformer/diffusion_pytorch_model.safetensors", "checkpoints/step-0000004/model.safetensors",
                 "checkpoints/step-0000004/ema.safetensors"):
        a, b = load_file(whole / name), load_file(killed / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
    for name in ("optimizer.safetensors", "train_state.json", "random_states_0.safetensors",
                 "random_states_1.safetensors"):
        assert (whole / "checkpoints" / "step-0000004" / name).read_bytes() == \
            (killed / "checkpoints" / "step-0000004" / name).read_bytes(), name
    steps = [json.loads(line)["step"] for line in (killed / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
