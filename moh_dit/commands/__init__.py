"""The ``moh-dit`` command: ``moh-dit <command> [flags]``, one subcommand per task.

Each subcommand is a module here with ``parse_args(argv)``, ``main(args)`` and ``cli(argv)``;
``python -m moh_dit.commands <command>`` and, from a clone, ``python scripts/<module>.py`` run
the same code. This module imports no command: ``moh-dit --help`` stays instant.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["COMMANDS", "command_name", "command_prog", "main"]

# subcommand -> (module, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train a MoH-DiT or DiT on an image folder or a latent cache"),
    "sample": ("sample", "sample images (PNG folder and ADM .npz) with any number of processes"),
    "evaluate": ("evaluate", "FID, sFID, IS, precision/recall and class accuracy of samples"),
    "sweep": ("sweep_head_ratio", "FID and class accuracy against the head activation ratio"),
    "convert": ("convert_checkpoint", "convert the release's, DiT's or diffusers' checkpoints"),
    "upcycle": ("upcycle", "turn a dense DiT into a MoH-DiT"),
    "export": ("export_pipeline", "write (and push) a self-contained diffusers pipeline folder"),
    "extract-latents": ("extract_latents", "encode an image folder into a latent cache"),
    "train-classifier": ("train_classifier", "train the small classifier behind class accuracy"),
    "make-demo-dataset": ("make_demo_dataset", "draw the demo's dataset of shapes"),
    "demo": ("demo", "the whole job offline on the CPU, on data the package draws"),
    "upcycle-demo": ("upcycle_demo", "upcycling against training from scratch, at demo scale"),
    "plot-head-usage": ("plot_head_usage", "figures of which heads each layer uses (from samples or a training log)"),
    "app": ("app", "a local web app: sample at any head ratio, with the head usage beside the images"),
}


def command_name(module: str) -> str | None:
    """The subcommand of a command module (``moh_dit.commands.sweep_head_ratio`` -> ``sweep``)."""
    package, _, leaf = module.rpartition(".")
    if package != __name__:
        return None
    return next((name for name, (mod, _) in COMMANDS.items() if mod == leaf), None)


def command_prog(module: str) -> str:
    """``moh-dit <command>``, the name a command module's parser shows (``module``: its
    ``__spec__.name``, which stays the module's name under ``python -m``)."""
    return f"moh-dit {command_name(module)}"


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: moh-dit <command> [flags]   (moh-dit <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``moh-dit <command> [flags]``; returns the command's exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"moh-dit: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__name__}.{COMMANDS[name][0]}")
    return module.cli(rest)  # its parser names itself `moh-dit <name>` (moh_dit.utils.cli)
