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
