import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Tests never touch the network; the Hub client must not try.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def randomize_(model: torch.nn.Module, std: float = 0.1, seed: int = 0) -> torch.nn.Module:
    """Give every parameter random values: DiT's init zeroes the adaLN and output layers,
    which would make every block the identity and hide bugs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


@pytest.fixture
def randomize():
    return randomize_


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"moh_dit_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_script():
    """``load_script("sample")`` imports ``scripts/sample.py`` as a module."""
    return _load_script


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime: what a refused command must not touch."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.fixture
def refuses(load_script, tmp_path, capsys):
    """``refuses("train", argv, match)`` runs ``scripts/train.py``'s ``cli(argv)`` and checks that it
    was refused: exit status 1 (or argparse's 2), ``match`` (a regex) in the one-line error on stderr,
    no traceback, and nothing under ``tmp_path`` created, changed or removed. Bad-input tables use
    it with paths under ``tmp_path``; prepare inputs before calling it."""
    import re

    def check(script: str, argv: list[str], match: str, status: int | None = None) -> str:
        before = _snapshot(tmp_path)
        capsys.readouterr()
        try:
            code = load_script(script).cli([str(a) for a in argv])
        except SystemExit as exit_:  # argparse's own usage errors
            code = exit_.code
        err = capsys.readouterr().err
        assert code != 0, f"{script} {argv} was accepted"
        if status is not None:
            assert code == status, (code, err)
        assert "Traceback" not in err, err
        assert re.search(match, err), f"expected /{match}/ in the error, got: {err!r}"
        assert _snapshot(tmp_path) == before, f"{script} {argv} wrote or changed files before refusing"
        return err

    return check
