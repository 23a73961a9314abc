"""The `moh-dit` command line: the dispatcher, its one error handler, the common flags, fast help,
and every command the README and the docs show."""

import errno
import logging
import re
import shlex
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from moh_dit.commands import COMMANDS, build_parser, main, run

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_command_and_unknown_ones_are_refused(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert re.search(rf"^  {name} +\S", out, re.M), name
    assert main(["no-such-command"]) == 2 and "no-such-command" in capsys.readouterr().err
    assert main([]) == 2


def test_the_package_and_every_commands_parser_load_no_heavy_library():
    code = ("import sys, moh_dit\nfrom moh_dit.commands import COMMANDS, build_parser\n"
            "for name in COMMANDS:\n    assert build_parser(name).format_help().startswith(f'usage: moh-dit {name} ')\n"
            "heavy = {'torch', 'diffusers', 'accelerate', 'scipy', 'matplotlib', 'gradio'} & set(sys.modules)\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", [None, *COMMANDS])
def test_help_answers_within_a_second(name):
    argv = [sys.executable, "-m", "moh_dit.commands", *([name] if name else []), "--help"]
    subprocess.run(argv, capture_output=True)  # compiled files written once
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0 and time.perf_counter() - start < 1.0, done.stderr


# ----- the one error handler --------------------------------------------------------------------

@pytest.fixture
def failing(monkeypatch):
    """``moh-dit fail`` raises the exception given to it: ``failing(error)`` sets which."""
    raised = []
    module = types.ModuleType("moh_dit.commands.fail")
    module.DESCRIPTION = "raises"
    module.build_parser = lambda parser: parser.add_argument("--count", type=int, default=1)
    module.main = lambda args: (logging.getLogger("moh_dit.x").info("working"), logging.getLogger("moh_dit.x").warning(
        "careful"), raised and (_ for _ in ()).throw(raised[0]))
    monkeypatch.setitem(sys.modules, "moh_dit.commands.fail", module)
    monkeypatch.setitem(COMMANDS, "fail", "fail")
    return raised.append


@pytest.mark.parametrize("error, line", [
    (ValueError("head_activation_ratio=0.1 is outside [0.5, 1.0]"), "head_activation_ratio=0.1 is outside [0.5, 1.0]"),
    (FileNotFoundError(errno.ENOENT, "no model_index.json", "/runs/x"), "no model_index.json: /runs/x"),
    (OSError(errno.ENOSPC, "No space left on device", "/data/run/x.png"), "No space left on device: /data/run/x.png"),
    (RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB"), "CUDA out of memory. Tried to allocate 2 GiB"),
    (MemoryError(), "MemoryError"),
    (KeyError("bug"), "KeyError: 'bug'"),
])
def test_any_error_is_one_line_and_debug_shows_the_traceback(failing, capsys, error, line):
    failing(error)
    assert run("fail", ["-q"]) == 1
    assert capsys.readouterr().err == f"warning: careful\nerror: {line}\n"
    with pytest.raises(type(error)):
        run("fail", ["--debug"])


def test_ctrl_c_exits_130_the_library_logs_progress_and_argparse_names_the_flag(failing, capsys):
    level = logging.getLogger("moh_dit").level
    failing(KeyboardInterrupt())
    assert run("fail", []) == 130
    assert capsys.readouterr().err == "working\nwarning: careful\nerror: interrupted\n"  # info shows without -q
    assert logging.getLogger("moh_dit").level == level  # the command's level does not outlive it
    with pytest.raises(SystemExit) as exit_:
        run("fail", ["--count", "many"])
    assert exit_.value.code == 2 and "--count" in capsys.readouterr().err


def test_a_ratio_the_model_cannot_reach_is_one_line_and_leaves_nothing(tmp_path, tiny_pipe, capsys):
    tiny_pipe().save_pretrained(tmp_path / "model")
    argv = ["--model", tmp_path / "model", "--output-dir", tmp_path / "samples", "--num-samples", "2",
            "--num-inference-steps", "1", "--head-activation-ratio", "0.1"]
    assert run("sample", [str(a) for a in argv]) == 1
    err = capsys.readouterr().err  # after the progress bars that -q hides in a process of its own
    assert err.count("error") == 1 and err.splitlines()[-1].startswith("error: ") and "0.1" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# ----- flags ------------------------------------------------------------------------------------

WRITES = [n for n in COMMANDS if n not in ("evaluate", "app")]  # evaluate writes a file, app nothing


@pytest.mark.parametrize("name", WRITES)
def test_every_command_writing_a_folder_takes_output_dir_in_three_spellings(name):
    parser = build_parser(name)
    for spelling in ("--output-dir", "--output_dir", "--output"):
        assert parser._option_string_actions[spelling].dest == "output_dir", spelling


def _shown_commands() -> list[tuple[str, str, str]]:
    """(where, command, flags) of every ``moh-dit COMMAND ...`` (or ``-m moh_dit.commands COMMAND``)
    in a shell block of README.md and docs/*.md; ``[...]`` marks optional flags."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                match = re.search(r"(?:^|\s)(?:moh-dit|-m moh_dit\.commands) ([a-z][\w-]*)(.*)", line.split("#")[0])
                if match:
                    found.append((f"{path.relative_to(ROOT)}: {match.group(0).strip()[:60]}", *match.groups()))
    return found


SHOWN = _shown_commands()


@pytest.mark.parametrize("where, command, flags", SHOWN, ids=[where for where, _, _ in SHOWN])
def test_every_command_shown_in_the_docs_parses(where, command, flags):
    assert command in COMMANDS, f"{where}: no command {command!r}"
    build_parser(command).parse_args(shlex.split(re.sub(r"\[([^\]]*)\]", r"\1", flags)))


@pytest.mark.slow
def test_scripts_and_the_console_script_start_the_same_command(tmp_path):
    console = shutil.which("moh-dit", path=str(Path(sys.executable).parent))
    starts = [[sys.executable, ROOT / "scripts" / "convert_checkpoint.py"]] + [[console, "convert"]] * bool(console)
    for start in starts:
        done = subprocess.run([*map(str, start), "--help"], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0 and done.stdout.startswith("usage: moh-dit convert "), (start, done.stderr)
