"""How much the machine can hold: sizes are checked against it before memory is spent.

A sample count, a batch size or a model dimension that cannot fit would otherwise fail
minutes later with a MemoryError (or the kernel's OOM killer) after records were written;
:func:`check_fits_in_memory` refuses it in one line first.
"""

from __future__ import annotations

import os

__all__ = ["available_memory", "check_fits_in_memory"]


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


def check_fits_in_memory(nbytes: float, what: str, advice: str, available: int | None = None) -> None:
    """Refuse ``what`` (e.g. ``"--num-samples 100000000"``) when it needs ``nbytes`` of memory
    and the machine has less available; ``advice`` says what to do instead. ``available``
    overrides the measurement (tests). Where the system does not say, nothing is refused."""
    available = available_memory() if available is None else available
    if available is not None and nbytes > available:
        raise ValueError(f"{what} needs about {_human(nbytes)} of memory, more than the {_human(available)} "
                         f"available on this machine; {advice}.")
