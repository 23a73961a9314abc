"""The promises every command that writes keeps, held by moh_dit.outputs: one writer per folder under
any spelling, overwrite only of the same command's own folder, no output inside an input, atomic
files and folders, scratch of a killed run removed, the umask's permissions, and nothing left
behind that blocks a rerun."""

import errno
import os
import signal
import stat
import subprocess
import sys

import pytest

from moh_dit.outputs import MARKER, SCRATCH, atomic_write, check_outside_inputs, marked_by, output_folder, write_json


def _write(folder, name="result.txt", text="result"):
    (folder / name).write_text(text)


# ----- one writer -------------------------------------------------------------------------------

HOLDER = """
import os, sys, time
from moh_dit.outputs import output_folder
with output_folder(sys.argv[1], "train", resume=True):
    child = os.fork()  # as a DataLoader worker: it outlives its parent for a while
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
"""


def test_one_writer_under_any_spelling_and_a_lock_free_when_its_holder_dies(tmp_path):
    real = tmp_path / "real"
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)  # made by the first holder
    for held, used in ((real, tmp_path / "alias"), (tmp_path / "alias", tmp_path / "x" / ".." / "real")):
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(held)], stdout=subprocess.PIPE, text=True)
        child = int(holder.stdout.readline())
        try:
            with pytest.raises(FileExistsError, match=r"being written by moh-dit train \(pid") as error:
                with output_folder(used, "train", resume=True):
                    pass
            assert error.value.errno == errno.EBUSY
            holder.kill()
            holder.wait()
            os.kill(child, 0)  # the forked child still runs...
            with output_folder(used, "train", resume=True):  # ...and the run can be resumed at once
                pass
        finally:
            holder.kill()
            os.kill(child, signal.SIGKILL)
    with output_folder(tmp_path / "model", "convert", publish=True), pytest.raises(FileExistsError):
        with output_folder(tmp_path / "model", "export", publish=True):  # in one process, before it exists
            pass
    with output_folder(real, "train", resume=True):  # free again
        pass


def test_a_link_in_place_of_the_lock_is_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    (tmp_path / ".out.lock").symlink_to(victim)
    with pytest.raises(OSError):
        with output_folder(tmp_path / "out", "sample"):
            pass
    assert victim.read_text() == "the user's file\n" and not (tmp_path / "out").exists()


# ----- overwrite only our own -------------------------------------------------------------------

def test_overwrite_replaces_only_what_the_same_command_wrote(tmp_path):
    out = tmp_path / "model"
    with output_folder(out, "convert", publish=True) as folder:
        _write(folder, text="first")
    with pytest.raises(FileExistsError):
        with output_folder(out, "convert", publish=True):
            pass
    with output_folder(out, "convert", publish=True, overwrite=True) as folder:
        _write(folder, text="second")
    assert (out / "result.txt").read_text() == "second" and marked_by(out) == "moh-dit convert"
    with pytest.raises(FileExistsError, match="written by moh-dit convert") as error:
        with output_folder(out, "export", publish=True, overwrite=True):
            pass
    assert error.value.filename == str(out) and (out / "result.txt").read_text() == "second"


@pytest.mark.parametrize("publish", [True, False])
def test_overwrite_never_deletes_a_file_the_command_did_not_write(tmp_path, publish):
    out = tmp_path / "out"
    with output_folder(out, "export", publish=publish) as folder:
        _write(folder)
    (out / "sub").mkdir()
    (out / "sub" / "notes.txt").write_text("the user's notes")
    with pytest.raises(FileExistsError) as error:
        with output_folder(out, "export", publish=publish, overwrite=True):
            pass
    assert error.value.filename == str(out / "sub" / "notes.txt")  # the refusal names the file
    assert (out / "sub" / "notes.txt").read_text() == "the user's notes" and (out / "result.txt").exists()


def test_a_users_folder_or_file_is_never_replaced(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    (tmp_path / "file.txt").write_text("mine")
    for path in (user, tmp_path / "file.txt"):
        with pytest.raises(FileExistsError) as error:
            with output_folder(path, "sample", overwrite=True):
                pass
        assert error.value.filename == str(path)
    assert (user / "notes.txt").read_text() == "mine" and (tmp_path / "file.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    with output_folder(tmp_path / "empty", "sample", overwrite=True) as folder:  # nothing to lose
        _write(folder)


def test_resume_keeps_only_the_same_commands_folder(tmp_path):
    out = tmp_path / "run"
    with output_folder(out, "train", resume=True) as folder:
        _write(folder, "step-1")
    with output_folder(out, "train", resume=True) as folder:
        assert (folder / "step-1").exists()
        _write(folder, "step-2")
    with pytest.raises(FileExistsError) as error:
        with output_folder(out, "sample", resume=True):
            pass
    assert error.value.filename == str(out) and (out / "step-2").exists()


# ----- no output inside an input ----------------------------------------------------------------

@pytest.mark.parametrize("output, source", [("data", "data"), ("data/run", "data"), ("runs", "runs/data"),
                                            ("alias/run", "data")])
def test_no_output_inside_an_input(tmp_path, output, source):
    (tmp_path / source).mkdir(parents=True)
    (tmp_path / "alias").symlink_to(tmp_path / "data", target_is_directory=True)
    with pytest.raises(ValueError, match="data"):
        with output_folder(tmp_path / output, "train", inputs={"data_dir": tmp_path / source, "vae": None}):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"alias", source.split("/")[0]})


def test_an_input_file_protects_that_file_not_its_folder(tmp_path):
    (tmp_path / "weights.pt").write_bytes(b"w")
    check_outside_inputs(tmp_path / "model", {"checkpoint": tmp_path / "weights.pt"})
    with pytest.raises(ValueError):
        check_outside_inputs(tmp_path / "weights.pt", {"checkpoint": tmp_path / "weights.pt"})
    with output_folder(tmp_path / "model", "convert", publish=True, inputs={"checkpoint": tmp_path / "weights.pt"}):
        pass


# ----- atomic writes and scratch ----------------------------------------------------------------

def test_a_failed_write_leaves_no_half_written_file_and_a_link_is_replaced_not_followed(tmp_path):
    target = tmp_path / "metrics.json"
    write_json(target, {"fid": 1.0})
    with pytest.raises(RuntimeError):
        with atomic_write(target, "w") as f:
            f.write('{"fid": ')
            raise RuntimeError("killed mid-write")
    assert target.read_text() == '{\n  "fid": 1.0\n}\n' and sorted(p.name for p in tmp_path.iterdir()) == [target.name]
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    (tmp_path / "out.txt").symlink_to(victim)
    with atomic_write(tmp_path / "out.txt", "w") as f:  # replaces a link, never the file it points to
        f.write("result")
    assert victim.read_text() == "the user's file" and not (tmp_path / "out.txt").is_symlink()


def test_a_failed_build_publishes_nothing_and_keeps_the_old_folder(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with output_folder(out, "convert", publish=True) as folder:
            _write(folder)
            raise RuntimeError("failed")
    assert list(tmp_path.iterdir()) == []
    with output_folder(out, "convert", publish=True) as folder:
        _write(folder, text="old")
    with pytest.raises(RuntimeError):
        with output_folder(out, "convert", publish=True, overwrite=True) as folder:
            _write(folder, text="new")
            raise RuntimeError("failed")
    assert (out / "result.txt").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_scratch_a_killed_run_left_is_removed_by_the_next_run(tmp_path):
    out = tmp_path / "samples"
    with output_folder(out, "sample") as folder:
        _write(folder, "000000.png")
    beside = tmp_path / f"{SCRATCH}samples-1234abcd"  # a folder being published when the run died
    inside = out / f"{SCRATCH}000001.png-89abcdef"  # a file being written
    beside.mkdir()
    inside.write_bytes(b"half")
    with output_folder(out, "sample", resume=True):
        assert not beside.exists() and not inside.exists() and (out / "000000.png").exists()


def test_files_get_the_permissions_the_umask_gives(tmp_path):
    before = os.umask(0o027)
    try:
        with output_folder(tmp_path / "model", "convert", publish=True) as folder:
            write_json(folder / "config.json", {})
            (folder / "sub").mkdir()
            os.close(os.open(folder / "sub" / "weights.safetensors", os.O_CREAT | os.O_WRONLY, 0o600))  # as safetensors
    finally:
        os.umask(before)
    model = tmp_path / "model"
    assert stat.S_IMODE(model.stat().st_mode) == 0o750 and stat.S_IMODE((model / "sub").stat().st_mode) == 0o750
    for file in ("config.json", "sub/weights.safetensors", MARKER):
        assert stat.S_IMODE((model / file).stat().st_mode) == 0o640, file


# ----- failing early blocks nothing -------------------------------------------------------------

def test_failing_before_the_first_result_blocks_nothing(tmp_path):
    out = tmp_path / "samples"
    with pytest.raises(ValueError):
        with output_folder(out, "sample", setup=("sample_config.json",)) as folder:
            write_json(folder / "sample_config.json", {})
            raise ValueError("bad data found after the folder was made")
    assert not out.exists()
    with output_folder(out, "sample") as folder:  # the fixed command reruns without --overwrite
        _write(folder, "000000.png")
    with pytest.raises(ValueError):  # a result exists: the folder stays for a resume
        with output_folder(out, "sample", resume=True):
            raise ValueError("failed later")
    assert (out / "000000.png").exists() and not list(tmp_path.glob(".*.lock"))  # the lock goes with its holder
