"""The error hierarchy: library messages name Python parameters; a command shows its flags."""

import pytest

from moh_dit.errors import DamagedFile, FolderInUse, InvalidInput, MoHDiTError, OutputExists, TrainingDiverged
from moh_dit.utils.cli import ArgumentParser, run_cli


def test_each_error_is_also_the_builtin_callers_catch():
    assert issubclass(InvalidInput, ValueError) and issubclass(DamagedFile, ValueError)
    assert issubclass(FolderInUse, FileExistsError) and issubclass(OutputExists, FileExistsError)
    assert issubclass(TrainingDiverged, FloatingPointError)
    for cls in (InvalidInput, FolderInUse, OutputExists, DamagedFile, TrainingDiverged):
        error = cls("x_y=3 is wrong", parameters="x_y")
        assert isinstance(error, MoHDiTError) and str(error) == "x_y=3 is wrong" and error.parameters == ("x_y",)


def test_for_command_names_whole_parameters_only():
    error = InvalidInput("output_dir=a lies inside data_dir=b; output_dir_name and cfg.output_dir stay",
                         parameters=("output_dir", "data_dir"))
    shown = error.for_command({"output_dir": "--output-dir", "data_dir": "--data-dir"})
    assert shown == "--output-dir=a lies inside --data-dir=b; output_dir_name and cfg.output_dir stay"
    assert error.for_command({}) == str(error)  # a name with no flag stays as the library said it


def _command(error):
    def parse_args(argv):
        parser = ArgumentParser(prog="moh-dit fake")
        parser.add_argument("--output-dir", "--output", dest="output_dir")
        parser.add_argument("--num-inference-steps", type=int)
        return parser.parse_args(argv)

    def main(args):
        raise error

    return main, parse_args


@pytest.mark.parametrize("error, expected", [
    (InvalidInput("num_inference_steps=0 must be >= 1", parameters="num_inference_steps"),
     "error: --num-inference-steps=0 must be >= 1"),
    (FolderInUse("output_dir run is being written by pid 7", parameters="output_dir"),
     "error: --output-dir run is being written by pid 7"),
])
def test_a_command_shows_the_library_error_with_its_flags(error, expected, capsys):
    main, parse_args = _command(error)
    assert run_cli(main, parse_args, ["--output", "run"]) == 1
    assert capsys.readouterr().err.strip().endswith(expected)


def test_debug_keeps_the_typed_error():
    main, parse_args = _command(InvalidInput("bad", parameters="output_dir"))
    with pytest.raises(InvalidInput):
        run_cli(main, parse_args, ["--debug"])
