"""The `moh-dit` command and the flag spellings every command accepts."""

import logging

import pytest

from moh_dit.commands import COMMANDS, main
from moh_dit.utils.cli import ArgumentParser
from moh_dit.utils.logging import get_logger, set_verbosity


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
