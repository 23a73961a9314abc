"""The rules every command that writes follows (moh_dit.utils.output_folders, io, cli): one
writer per output folder, locks never written through links, --overwrite only over the
package's own output, outputs never inside inputs, faults of the machine in one line."""

from __future__ import annotations

import errno
import json
import os

import pytest

from moh_dit.utils.cli import ArgumentParser, run_cli
from moh_dit.utils.io import LinkRefusedError, atomic_write, lock_file
from moh_dit.utils.output_folders import (OUTPUT_MARKER, OutputFolderBusyError, check_output_folder,
                                          check_outside_inputs, hold_output_folder, is_package_output,
                                          write_output_marker)
from moh_dit.utils.resources import check_fits_in_memory


@pytest.mark.parametrize("target", ["file", "missing"])
@pytest.mark.parametrize("create", [True, False])
def test_lock_file_refuses_a_link_and_leaves_its_target_alone(tmp_path, target, create):
    victim = tmp_path / "victim.txt"
    if target == "file":
        victim.write_text("user data\n")
    (tmp_path / ".lock").symlink_to(victim)
    with pytest.raises(LinkRefusedError, match="symbolic link"):
        lock_file(tmp_path / ".lock", create=create)
    assert (victim.read_text() == "user data\n") if target == "file" else not victim.exists()


def test_one_writer_per_output_folder_and_the_lock_goes_away(tmp_path):
    out = tmp_path / "out"
    with hold_output_folder(out, "sample", "--output"):
        lock = tmp_path / ".out.lock"
        assert json.loads(lock.read_text())["command"] == "moh-dit sample"
        with pytest.raises(OutputFolderBusyError, match=r"--output .*out is being written by another command "
                                                        r"\(moh-dit sample, pid \d+"):
            with hold_output_folder(tmp_path / "x" / ".." / "out", "sample", "--output"):
                pass
    assert not lock.exists() and not out.exists()
    with hold_output_folder(out, "convert"):  # free again
        pass


def test_a_link_in_place_of_the_output_lock_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("user data\n")
    (tmp_path / ".out.lock").symlink_to(victim)
    with pytest.raises(LinkRefusedError):
        with hold_output_folder(tmp_path / "out", "sample"):
            pass
    assert victim.read_text() == "user data\n"


def test_overwrite_replaces_only_a_marked_or_recognised_folder(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        check_output_folder(user, False)
    with pytest.raises(FileExistsError, match="which is not the output of a moh-dit command"):
        check_output_folder(user, True)
    check_output_folder(user, True, is_ours=lambda p: (p / "notes.txt").exists())
    write_output_marker(user, "convert")
    assert is_package_output(user)
    check_output_folder(user, True)
    (user / OUTPUT_MARKER).unlink()
    (user / OUTPUT_MARKER).symlink_to(tmp_path / "elsewhere.json")
    write_output_marker(tmp_path, "convert")  # a marker reached through a link does not count
    (tmp_path / OUTPUT_MARKER).rename(tmp_path / "elsewhere.json")
    assert not is_package_output(user)


@pytest.mark.parametrize("output, source, word", [("data", "data", "is"), ("data/run", "data", "lies inside"),
                                                  ("runs", "runs/data", "contains")])
def test_outputs_never_inside_inputs(tmp_path, output, source, word):
    (tmp_path / source).mkdir(parents=True)
    with pytest.raises(ValueError, match=f"--output-dir .* {word} --data-dir"):
        check_outside_inputs(tmp_path / output, {"--data-dir": tmp_path / source, "--other": None})
    check_outside_inputs(tmp_path / "elsewhere", {"--data-dir": tmp_path / source})


def test_outputs_inside_inputs_are_found_through_links(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "data")
    with pytest.raises(ValueError, match="lies inside"):
        check_outside_inputs(tmp_path / "alias" / "run", {"--data-dir": tmp_path / "data"})


def test_a_failed_write_names_its_file(tmp_path, monkeypatch):
    target = tmp_path / "big.bin"

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match=f"while writing {target}") as error:
        with atomic_write(target) as f:
            monkeypatch.setattr(f, "write", full)
            f.write(b"x")
    assert error.value.errno == errno.ENOSPC and error.value.filename == str(target)
    assert list(tmp_path.iterdir()) == []


def _command(error):
    def parse(argv):
        return ArgumentParser().parse_args(argv)

    def main(args):
        raise error

    return main, parse


@pytest.mark.parametrize("error, expected", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/run/x.png"), "No space left on device: /data/run/x.png"),
    (MemoryError(), "out of memory"),
    (PermissionError(errno.EACCES, "Permission denied", "/srv/model"), "Permission denied: /srv/model"),
])
def test_faults_of_the_machine_are_one_line_and_debug_shows_the_traceback(capsys, error, expected):
    main, parse = _command(error)
    assert run_cli(main, parse, []) == 1
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(type(error)):
        run_cli(main, parse, ["--debug"])


def test_a_bug_keeps_its_traceback():
    main, parse = _command(OSError(errno.EBADF, "Bad file descriptor"))
    with pytest.raises(OSError):
        run_cli(main, parse, [])
    main, parse = _command(KeyError("bug"))
    with pytest.raises(KeyError):
        run_cli(main, parse, [])


def test_sizes_beyond_the_machine_are_refused():
    with pytest.raises(ValueError, match=r"--num-samples 9 needs about 1\.0 GiB of memory, more than the 1\.0 MiB "
                                         r"available on this machine; use fewer\."):
        check_fits_in_memory(2**30, "--num-samples 9", "use fewer", available=2**20)
    check_fits_in_memory(2**19, "--num-samples 9", "use fewer", available=2**20)
