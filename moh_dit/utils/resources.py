"""How much the machine can hold: sizes are checked against it before memory or disk is spent.

A sample count, a batch size or a model dimension that cannot fit would otherwise fail
minutes later with a MemoryError (or the kernel's OOM killer) after records were written, and
a dataset too large for the disk would fill it for hours; :func:`check_fits_in_memory` and
:func:`check_fits_on_disk` refuse it in one line first, naming the parameter that asked for it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import InvalidInput

__all__ = ["available_memory", "check_fits_in_memory", "check_fits_on_disk"]


def available_memory() -> int | None:
    """Bytes of memory a new allocation can get without swapping (``MemAvailable`` on Linux,
    else the free physical pages), or None where the system does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(nbytes) < 1024 or unit == "PiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def check_fits_in_memory(nbytes: float, what: str, advice: str, available: int | None = None,
                         parameters: str | tuple[str, ...] = ()) -> None:
    """Refuse ``what`` (e.g. ``"num_samples 100000000"``) when it needs ``nbytes`` of memory
    and the machine has less available; ``advice`` says what to do instead; ``parameters`` are
    the names in ``what`` (a command shows them as its flags). ``available`` overrides the
    measurement (tests). Where the system does not say, nothing is refused."""
    available = available_memory() if available is None else available
    if available is not None and nbytes > available:
        raise InvalidInput(f"{what} needs about {_human(nbytes)} of memory, more than the {_human(available)} "
                           f"available on this machine; {advice}.", parameters=parameters)


def check_fits_on_disk(nbytes: float, folder: str | os.PathLike, what: str, advice: str,
                       parameters: str | tuple[str, ...] = ()) -> None:
    """Refuse ``what`` when it writes about ``nbytes`` under ``folder`` (which need not exist
    yet: its nearest existing parent is measured) and that file system has less free space."""
    existing = Path(folder).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if nbytes > free:
        raise InvalidInput(f"{what} writes about {_human(nbytes)}, more than the {_human(free)} free on the disk of "
                           f"{folder}; {advice}.", parameters=parameters)
