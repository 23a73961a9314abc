"""The package's one way to publish a folder and to switch TF32."""

import pytest
import torch

from moh_dit.utils.io import publish_folder
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
