"""The `moh-dit` command and the flag spellings every command accepts."""

import argparse
import logging
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moh_dit.commands import COMMANDS, main
from moh_dit.utils.cli import ArgumentParser
from moh_dit.utils.logging import get_logger, get_verbosity, set_verbosity

ROOT = Path(__file__).resolve().parents[1]


def test_every_subcommand_has_a_module_with_cli(load_script):
    for name, (module, _) in COMMANDS.items():
        command = load_script(module)
        assert callable(command.cli) and callable(command.parse_args) and callable(command.main), name


def test_unknown_command_and_help(capsys):
    assert main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main([]) == 2


def test_underscore_spellings_and_aliases():
    parser = ArgumentParser()
    parser.add_argument("--output-dir")
    parser.add_argument("--data-dir")
    parser.add_argument("--global-batch-size", type=int)
    parser.add_alias("--train_data_dir", "--data-dir")
    args = parser.parse_args(["--output_dir", "o", "--train_data_dir=d", "--global_batch_size", "4"])
    assert (args.output_dir, args.data_dir, args.global_batch_size) == ("o", "d", 4)
    assert "--output_dir" not in parser.format_help()  # each flag listed once
    assert parser.parse_args(["--output-dir", "my_out_dir"]).output_dir == "my_out_dir"  # values are not respelled
    with pytest.raises(SystemExit):
        parser.parse_args(["--no_such_flag", "1"])
    with pytest.raises(ValueError, match="not a flag"):
        parser.add_alias("--x", "--missing")


def test_quiet_and_verbose_set_the_package_log_level(capsys):
    parser = ArgumentParser()
    assert parser.parse_args([]).verbosity is None
    assert parser.parse_args(["-q"]).verbosity == "warning"
    assert parser.parse_args(["--verbose"]).verbosity == "debug"
    log = get_logger("moh_dit.test")
    try:
        set_verbosity("warning")
        log.info("hidden")
        log.warning("shown")
        captured = capsys.readouterr()
        assert "hidden" not in captured.out and captured.err == "warning: shown\n"
        set_verbosity("info")
        log.info("progress")
        assert capsys.readouterr().out == "progress\n"
    finally:
        set_verbosity(logging.WARNING)


# --------------------------------------------------------------------------------------
# Every command's parser: its name, the underscore spellings, one output flag
# --------------------------------------------------------------------------------------

# Commands whose output is a file (evaluate's JSON), not a folder: no --output-dir.
WRITES_A_FILE = {"evaluate"}
# Commands that write no output of their own (app serves a page; its files go to a temporary folder).
WRITES_NOTHING = {"app"}
def _parser(load_script, name, monkeypatch):
    """The parser that ``moh-dit <name>`` builds, caught before it parses anything."""
    made = []
    with monkeypatch.context() as patch:
        patch.setattr(ArgumentParser, "parse_args", lambda self, *a, **k: made.append(self) or argparse.Namespace())
        load_script(COMMANDS[name][0]).parse_args([])
    return made[-1]


def _value(action) -> list[str]:
    """A value the flag's type accepts (none for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    for value in ("1", "0.5", "x"):
        try:
            (action.type or str)(value)
            return [value]
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            pass
    raise AssertionError(f"no test value for {action.option_strings}")


def _valid_argv(parser, without=None) -> list[str]:
    """The required flags with values (one member of each required group), leaving out
    ``without`` and the members of its groups."""
    skip = {without} if without is not None else set()
    for group in parser._mutually_exclusive_groups:
        if without in group._group_actions:
            skip |= set(group._group_actions)
    argv = []
    for group in parser._mutually_exclusive_groups:
        if group.required and not skip & set(group._group_actions):
            argv += [group._group_actions[0].option_strings[-1], *_value(group._group_actions[0])]
    for action in parser._actions:
        if action.required and action not in skip:
            argv += [action.option_strings[-1], *_value(action)]
    return argv


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_names_the_command_however_it_is_started(name, load_script, capsys):
    module = load_script(COMMANDS[name][0])
    for start in (module.cli, module.parse_args, lambda argv: main([name, *argv])):
        with pytest.raises(SystemExit) as exit_:
            start(["--help"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: moh-dit {name} "), start
    # Usage errors name it too.
    with pytest.raises(SystemExit):
        module.cli(["--no-such-flag"])
    assert f"moh-dit {name}: error:" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_long_flag_parses_in_its_underscore_spelling(name, load_script, monkeypatch):
    parser = _parser(load_script, name, monkeypatch)
    checked = 0
    for action in parser._actions:
        for flag in action.option_strings:
            if not flag.startswith("--") or "-" not in flag[2:] or isinstance(action, argparse._HelpAction):
                continue
            argv = _valid_argv(parser, without=action)
            dashed = parser.parse_args(argv + [flag, *_value(action)])
            underscored = parser.parse_args(argv + ["--" + flag[2:].replace("-", "_"), *_value(action)])
            assert underscored == dashed, flag
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("name", [n for n in COMMANDS if n not in WRITES_A_FILE | WRITES_NOTHING])
def test_every_command_writing_a_folder_takes_output_dir(name, load_script, monkeypatch):
    parser = _parser(load_script, name, monkeypatch)
    assert "--output-dir" in parser._option_string_actions, "not a flag"
    argv = _valid_argv(parser, without=parser._option_string_actions["--output-dir"])
    for spelling in ("--output-dir", "--output_dir", "--output"):  # --output: the name before --output-dir
        assert parser.parse_args(argv + [spelling, "somewhere"]).output_dir == "somewhere", spelling
    usage = " ".join(parser.format_usage().split())
    assert "--output-dir OUTPUT_DIR" in usage and not re.search(r"--output(?![-\w])", usage)  # the alias stays hidden


# --------------------------------------------------------------------------------------
# Quiet, controllable output
# --------------------------------------------------------------------------------------


def _tiny_checkpoint(tmp_path):
    from moh_dit import MoHDiTTransformer2DModel
    from moh_dit.hub.convert import model_to_release_state_dict

    model = MoHDiTTransformer2DModel.from_preset("DiT-Tiny", sample_size=8)
    torch.save({"ema": model_to_release_state_dict(model)}, tmp_path / "dense.pt")
    return tmp_path / "dense.pt"


def test_quiet_silences_the_commands_and_the_level_is_restored(tmp_path, load_script, capsys):
    before = get_verbosity()
    demo = load_script("make_demo_dataset")
    tiny = ["--images-per-class", "1", "--image-size", "12"]
    assert demo.cli(["--output-dir", str(tmp_path / "shown"), *tiny]) == 0
    assert "wrote 12 images" in capsys.readouterr().out
    assert get_verbosity() == before  # the command's info level does not outlive it
    assert demo.cli(["--output-dir", str(tmp_path / "quiet"), *tiny, "-q"]) == 0
    assert demo.cli(["--output_dir", str(tmp_path / "quieter"), *tiny, "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert (tmp_path / "quiet" / "red_square").is_dir() and (tmp_path / "quieter" / "red_square").is_dir()

    convert = load_script("convert_checkpoint")
    argv = ["--checkpoint", str(_tiny_checkpoint(tmp_path)), "--preset", "DiT-Tiny"]
    assert convert.cli(argv + ["--output-dir", str(tmp_path / "model")]) == 0
    assert capsys.readouterr().out.startswith("Wrote DiT-Tiny (")
    assert convert.cli(argv + ["--output-dir", str(tmp_path / "model2"), "-q"]) == 0
    assert capsys.readouterr() == ("", "")
    # Errors are shown whatever the level.
    assert convert.cli(argv + ["--output-dir", str(tmp_path / "model"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "already exists" in err
    assert get_verbosity() == before


def test_main_called_from_python_runs_at_its_flags_level(tmp_path, load_script, capsys, monkeypatch):
    demo = load_script("make_demo_dataset")
    tiny = ["--images-per-class", "1", "--image-size", "12"]
    demo.main(demo.parse_args(["--output-dir", str(tmp_path / "a"), *tiny]))
    assert "wrote 12 images" in capsys.readouterr().out
    demo.main(demo.parse_args(["--output-dir", str(tmp_path / "b"), *tiny, "-q"]))
    assert capsys.readouterr().out == ""
    # MOH_DIT_VERBOSITY stands in for the flags when none is given; the flags win.
    monkeypatch.setenv("MOH_DIT_VERBOSITY", "warning")
    assert demo.cli(["--output-dir", str(tmp_path / "c"), *tiny]) == 0
    assert capsys.readouterr().out == ""
    assert demo.cli(["--output-dir", str(tmp_path / "d"), *tiny, "-v"]) == 0
    assert "wrote 12 images" in capsys.readouterr().out


def test_library_calls_print_nothing(tmp_path, load_script, capsys):
    """What the commands say is theirs: the library they call prints nothing at the default
    level (extract_latents' summary: tests/test_latents.py)."""
    from moh_dit.data.demo_data import make_demo_dataset
    from moh_dit.hub.convert import convert_checkpoint

    assert load_script("make_demo_dataset").cli(["--output-dir", str(tmp_path / "cli"), "--images-per-class", "1",
                                                 "--image-size", "12"]) == 0
    capsys.readouterr()  # after a command in the same process, the library is quiet again
    make_demo_dataset(tmp_path / "data", images_per_class=1, image_size=12)
    convert_checkpoint(_tiny_checkpoint(tmp_path), "DiT-Tiny", tmp_path / "model")
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_every_way_to_start_a_command(tmp_path):
    """In real processes, from a folder outside the clone: the console script, python -m (the
    package and the module), and scripts/ all run the same command under the same name; -q
    leaves stdout empty. (The installed wheel: tests/test_packaging.py.)"""
    starts = [[sys.executable, "-m", "moh_dit.commands", "convert"],
              [sys.executable, "-m", "moh_dit.commands.convert_checkpoint"],
              [sys.executable, ROOT / "scripts" / "convert_checkpoint.py"]]
    console = shutil.which("moh-dit", path=str(Path(sys.executable).parent))
    if console is not None:  # the console script of this environment's install
        starts.append([console, "convert"])
    for start in starts:
        result = subprocess.run([*map(str, start), "--help"], cwd=tmp_path, capture_output=True, text=True)
        assert result.returncode == 0 and result.stdout.startswith("usage: moh-dit convert "), (start, result.stderr)
    argv = ["--output_dir", "shapes", "--images-per-class", "1", "--image-size", "12"]
    shown = subprocess.run([sys.executable, ROOT / "scripts" / "make_demo_dataset.py", *argv], cwd=tmp_path,
                           capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.startswith("wrote 12 images"), shown.stderr
    quiet = subprocess.run([sys.executable, "-m", "moh_dit.commands", "make-demo-dataset", *argv, "--overwrite", "-q"],
                           cwd=tmp_path, capture_output=True, text=True)
    assert (quiet.returncode, quiet.stdout) == (0, ""), quiet.stderr


# --------------------------------------------------------------------------------------
# Every command the README and the docs show parses
# --------------------------------------------------------------------------------------

def _shown_commands() -> list[tuple[str, str, str]]:
    """(where, command, flags) of every ``moh-dit <command> ...`` (or ``-m moh_dit.commands
    <command>``) in a shell block of README.md and docs/*.md; ``[...]`` marks optional flags."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                match = re.search(r"(?:^|\s)(?:moh-dit|-m moh_dit\.commands) ([a-z][\w-]*)(.*)", line.split("#")[0])
                if match:
                    found.append((f"{path.relative_to(ROOT)}: {match.group(0).strip()[:60]}", *match.groups()))
    return found


SHOWN = _shown_commands()


def test_the_docs_show_the_installed_command():
    assert len(SHOWN) >= 20 and {command for _, command, _ in SHOWN} >= {"train", "sample", "evaluate", "demo"}


@pytest.mark.parametrize("where, command, flags", SHOWN, ids=[where for where, _, _ in SHOWN])
def test_every_command_shown_in_the_docs_parses(where, command, flags, load_script):
    assert command in COMMANDS, f"{where}: no command {command!r}"
    load_script(COMMANDS[command][0]).parse_args(shlex.split(re.sub(r"\[([^\]]*)\]", r"\1", flags)))
