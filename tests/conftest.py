import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Tests never touch the network; the Hub client must not try.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Reference-statistics caches go to a temporary folder, never the real home cache
    (subprocesses inherit the variable)."""
    previous = os.environ.get("MOH_DIT_CACHE")
    os.environ["MOH_DIT_CACHE"] = str(tmp_path_factory.mktemp("moh-dit-cache"))
    yield
    if previous is None:
        os.environ.pop("MOH_DIT_CACHE", None)
    else:
        os.environ["MOH_DIT_CACHE"] = previous
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# diffusers' convention: tests marked `slow` (whole scripts in subprocesses, two-process
# launches, torch.compile, the demo end to end) run only with RUN_SLOW=1.
RUN_SLOW = os.environ.get("RUN_SLOW", "").strip().lower() in ("1", "true", "yes", "on")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test that takes many seconds; runs only with RUN_SLOW=1")


def pytest_collection_modifyitems(config, items):
    if RUN_SLOW:
        return
    skip = pytest.mark.skip(reason="slow test: set RUN_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def randomize_(model: torch.nn.Module, std: float = 0.1, seed: int = 0) -> torch.nn.Module:
    """Give every parameter random values: DiT's init zeroes the adaLN and output layers,
    which would make every block the identity and hide bugs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


@pytest.fixture(scope="session")
def randomize():
    return randomize_


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the tests of a module (``pytestmark = pytest.mark.usefixtures("one_thread")``),
    then the previous count: tiny tensors gain nothing from a second thread, and on a loaded
    machine every parallel region can wait for a busy core (measured: 34 s instead of 0.4 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_vae_(levels: int = 2, sample_size: int = 16, seed: int = 0, std: float | None = None):
    """A tiny diffusers AutoencoderKL (8 channels per level, 4 latent channels, downsampling
    2 ** (levels - 1)): diffusers' default initialisation drawn after ``torch.manual_seed(seed)``,
    or, with ``std``, every parameter N(0, std) from a generator seeded with ``seed``."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,) * levels, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * levels, up_block_types=("UpDecoderBlock2D",) * levels,
        norm_num_groups=4, sample_size=sample_size,
    )
    if std is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in vae.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return vae.eval()


@pytest.fixture(scope="session")
def tiny_vae():
    """``tiny_vae(levels=2, sample_size=16, seed=0, std=None)`` builds a tiny AutoencoderKL."""
    return tiny_vae_


def tiny_pipe_(seed: int = 0, dtype: torch.dtype | None = None, clip_sample: bool = False, vae=None, **overrides):
    """A MoHDiTPipeline around a randomized MoH-DiT-Tiny at 8 x 8 (DDPM scheduler)."""
    from moh_dit import MoHDiTPipeline, MoHDiTTransformer2DModel
    from moh_dit.pipelines.pipeline_moh_dit import make_scheduler

    model = randomize_(MoHDiTTransformer2DModel.from_preset("MoH-DiT-Tiny", sample_size=8, **overrides), seed=seed).eval()
    if dtype is not None:
        model = model.to(dtype)
    scheduler = make_scheduler("ddpm", clip_sample=True) if clip_sample else make_scheduler("ddpm")
    return MoHDiTPipeline(transformer=model, scheduler=scheduler, vae=vae)


@pytest.fixture(scope="session")
def tiny_pipe():
    """``tiny_pipe(seed=0, dtype=None, clip_sample=False, vae=None, **model_overrides)``."""
    return tiny_pipe_


class _Command:
    """``moh-dit NAME`` (the command or its module's name), run through the dispatcher; its
    module's names are its attributes."""

    def __init__(self, name: str):
        from moh_dit.commands import COMMANDS

        self.name = name if name in COMMANDS else next(n for n, m in COMMANDS.items() if m == name)
        self.module = importlib.import_module(f"moh_dit.commands.{COMMANDS[self.name]}")

    def cli(self, argv: list | None = None) -> int:
        from moh_dit.commands import run

        return run(self.name, [str(a) for a in argv or []])

    def __getattr__(self, name: str):
        return getattr(self.module, name)


@pytest.fixture(scope="session")
def load_script():
    """``load_script("sample").cli(argv)`` runs ``moh-dit sample`` as ``scripts/sample.py`` does."""
    return _Command


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime: what a refused command must not touch."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.fixture
def refuses(load_script, tmp_path, capsys):
    """``refuses("train", argv, match)`` runs ``moh-dit train`` with ``argv`` and checks that it
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
