"""The wheel holds every package of the source tree (an editable install hides a missing one)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, folders = set(config["packages"]), config["package-dir"]
    on_disk = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((name, *rel)))
    assert on_disk <= listed, f"pyproject.toml's packages lacks {sorted(on_disk - listed)}"
    assert listed <= on_disk, f"pyproject.toml lists packages that do not exist: {sorted(listed - on_disk)}"
