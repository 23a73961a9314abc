"""The wheel holds every package of the source tree (an editable install hides a missing one),
and the installed ``moh-dit`` command works from it alone."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed_in_pyproject():
    config = CONFIG["tool"]["setuptools"]
    on_disk = {".".join((name, *init.parent.relative_to(ROOT / folder).parts))
               for name, folder in config["package-dir"].items() for init in (ROOT / folder).rglob("__init__.py")}
    assert on_disk == set(config["packages"])


def test_install_commands_work_without_a_package_index_release():
    """moh-dit is not on PyPI: no install line in the README, the docs or a message the package
    prints (the loader file written into saved pipelines included) asks an index for it, and every
    extra such a line names exists in pyproject.toml."""
    import re

    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "moh_dit").rglob("*.py"),
             *(ROOT / "pipelines").glob("*.py")]
    extras = set(CONFIG["project"]["optional-dependencies"])
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"pip install (-U )?[\"']?moh[-_]dit\b(?! @)", text), path
        for named in re.findall(r'pip install (?:-e )?"?\.\[([a-z,]+)\]', text):
            assert set(named.split(",")) <= extras, (path, named)


def _expected_wheel_files() -> set[str]:
    """Every module of the source tree and every data file package-data names, as wheel paths."""
    config = CONFIG["tool"]["setuptools"]
    files = set()
    for name, folder in config["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                files.add("/".join((*name.split("."), *path.relative_to(ROOT / folder).parts)))
    for name, patterns in config.get("package-data", {}).items():
        folder = ROOT / config["package-dir"].get(name, name.replace(".", "/"))
        for pattern in patterns:
            files |= {"/".join((*name.split("."), p.name)) for p in folder.glob(pattern)}
    return files


def _run(argv, cwd, **kwargs):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{argv}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
def test_installed_wheel_runs_outside_the_source_tree(tmp_path):
    # Build the wheel from a copy of the sources (nothing is written in the working tree), offline.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in set(CONFIG["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
          tmp_path / "dist", src], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("moh_dit-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    missing = _expected_wheel_files() - names
    assert not missing, f"the wheel lacks {sorted(missing)}"
    assert "moh-dit = moh_dit.commands:main" in entry_points

    # A fresh environment: the wheel installed into it, the dependencies (torch, diffusers, ...)
    # borrowed from this interpreter's site-packages by a path file -- which adds the folder
    # only, so the editable install of the source tree there stays out.
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python, command = env / "bin" / "python", env / "bin" / "moh-dit"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
                .stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel], cwd=tmp_path)

    work = tmp_path / "work"  # outside the repository: nothing of the source tree is importable
    work.mkdir()
    where = _run([python, "-c", "import moh_dit, moh_dit.commands, moh_dit.pipelines; "
                  "print(moh_dit.__file__); print(moh_dit.pipelines.__file__)"], cwd=work).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where
    assert "make-demo-dataset" in _run([command, "--help"], cwd=work).stdout
    assert _run([python, "-m", "moh_dit.commands", "convert", "--help"], cwd=work).stdout.startswith(
        "usage: moh-dit convert ")

    # A tiny training run through the installed command.
    _run([command, "make-demo-dataset", "--output-dir", "data", "--images-per-class", "2", "--image-size", "16"],
         cwd=work)
    _run([command, "train", "--preset", "MoH-DiT-Tiny/2", "--data-dir", "data", "--vae", "none", "--image-size", "16",
          "--output-dir", "run", "--max-steps", "2", "--global-batch-size", "4", "--num-workers", "0",
          "--report-to", "none", "-q"], cwd=work)
    assert json.loads((work / "run" / "train_config.json").read_text())["max_steps"] == 2

