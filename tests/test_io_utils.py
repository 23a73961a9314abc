"""The package's one way to publish a folder and to switch TF32."""

import signal
import socket
import subprocess
import sys

import pytest
import torch

from moh_dit.utils.io import publish_folder, write_bytes_atomic
from moh_dit.utils.runtime import set_tf32, tf32_disabled


def test_publish_folder_appears_only_complete(tmp_path):
    out = tmp_path / "out"
    with publish_folder(out) as tmp:
        (tmp / "a.txt").write_text("1")
        assert not out.exists()  # nothing visible while it is being built
    assert (out / "a.txt").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_publish_folder_failure_leaves_the_old_folder(tmp_path):
    out = tmp_path / "out"
    with publish_folder(out) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with publish_folder(out, replace=True) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("crash while writing")
    assert (out / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_publish_folder_replaces_only_when_asked(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="already exists"):
        with publish_folder(out) as tmp:
            (tmp / "new.txt").write_text("new")
    assert (out / "mine.txt").read_text() == "user data"
    with publish_folder(out, replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in out.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_tf32_switch_and_restore():
    matmul = torch.backends.cuda.matmul
    name = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"
    before = getattr(matmul, name)
    try:
        set_tf32(True)
        enabled = getattr(matmul, name)
        with tf32_disabled():
            assert getattr(matmul, name) != enabled
        assert getattr(matmul, name) == enabled
        set_tf32(False)
        assert getattr(matmul, name) != enabled
    finally:
        setattr(matmul, name, before)


def test_atomic_write_gives_files_the_ordinary_mode(tmp_path):
    import os

    from moh_dit.utils.io import write_json_atomic

    old = os.umask(0o022)
    try:
        path = write_json_atomic(tmp_path / "a.json", {"x": 1})
    finally:
        os.umask(old)
    assert (path.stat().st_mode & 0o777) == 0o644


def _with_umask(mask, build):
    import os

    old = os.umask(mask)
    try:
        return build()
    finally:
        os.umask(old)


def _publish_a_model(out):
    """What a published model folder holds: a safetensors file (the library writes it owner-only
    through a temporary file), a JSON file, a subfolder and an executable script."""
    import os

    from safetensors.torch import save_file

    with publish_folder(out) as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text("{}")
        (tmp / "vae").mkdir()
        (tmp / "vae" / "weights.bin").write_bytes(b"1")
        fd = os.open(tmp / "run.sh", os.O_CREAT | os.O_WRONLY, 0o700)
        os.close(fd)
    return out


def _modes(root):
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in [root, *sorted(root.rglob("*"))]}


def test_published_folder_has_ordinary_permissions_under_umask_022(tmp_path):
    out = _with_umask(0o022, lambda: _publish_a_model(tmp_path / "model"))
    assert _modes(out) == {".": 0o755, "model.safetensors": 0o644, "config.json": 0o644, "vae": 0o755,
                           "vae/weights.bin": 0o644, "run.sh": 0o755}


def test_published_folder_stays_private_under_umask_077(tmp_path):
    from moh_dit.utils.io import write_bytes_atomic

    out = _with_umask(0o077, lambda: _publish_a_model(tmp_path / "model"))
    assert set(_modes(out).values()) == {0o700, 0o600}
    assert _modes(out)["model.safetensors"] == _modes(out)["config.json"] == 0o600
    assert _modes(out)["vae"] == _modes(out)["."] == 0o700
    path = _with_umask(0o077, lambda: write_bytes_atomic(tmp_path / "private" / "a.bin", b"x"))
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)


def test_current_umask_is_read_without_changing_it():
    import os

    from moh_dit.utils.io import current_umask

    assert _with_umask(0o027, current_umask) == 0o027
    assert _with_umask(0o022, current_umask) == 0o022
    old = os.umask(0o002)
    os.umask(old)
    assert current_umask() == old


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_scratch_a_killed_writer_left_is_removed_by_the_next_one(tmp_path, kind):
    """A writer killed mid-way leaves its hidden scratch beside the target; the next write of
    the same target removes it. Scratch of a live process is left alone."""
    target = tmp_path / "data"
    opened = "publish_folder(target) as t" if kind == "folder" else "atomic_write(target) as t"
    code = ("import time\nfrom pathlib import Path\nfrom moh_dit.utils.io import atomic_write, publish_folder\n"
            f"target = Path({str(target)!r})\nwith {opened}:\n    print('ready', flush=True)\n    time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".data.")]) == 1 and not target.exists()
    live = tmp_path / f".data.{'tmp' if kind == 'folder' else 'part'}-{socket.gethostname()}-1-keep"
    live.mkdir()  # pid 1 is always running
    if kind == "folder":
        with publish_folder(target) as t:
            (t / "x").write_text("2")
    else:
        write_bytes_atomic(target, b"2")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["data", live.name])
