"""Decisions shared by every process of a run: the main process decides (or every process
works) and all of them go on, or all raise the same error together -- none is left waiting
at a barrier for a process that gave up."""

from __future__ import annotations

from typing import Any, Callable

from .errors import CheckpointIntegrityError, RunFolderBusyError, TrainingDivergedError

_ERRORS = {cls.__name__: cls for cls in (RunFolderBusyError, CheckpointIntegrityError, FileExistsError,
                                          FileNotFoundError, ValueError, TrainingDivergedError, OSError)}


def on_main(accelerator, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the main process only and give its result -- or its error -- to every
    process, so that all of them go on or all raise together (none waits forever)."""
    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = fn()
        except Exception as exc:  # handed to the other processes, then raised here too
            error = exc
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        payload = [result, None if error is None else (type(error).__name__, str(error))]
        broadcast_object_list(payload, from_process=0)
        if not accelerator.is_main_process:
            result = payload[0]
            if payload[1] is not None:
                name, message = payload[1]
                cls = next((c for n, c in _ERRORS.items() if n == name), None)
                raise (cls(message) if cls is not None else RuntimeError(f"the main process failed: {name}: {message}"))
    if error is not None:
        raise error
    return result


def everywhere(accelerator, fn: Callable[[], Any]) -> None:
    """Run ``fn`` on every process; if it fails on any of them, raise on all."""
    error = None
    try:
        fn()
    except Exception as exc:  # reported to the others, then raised here
        error = exc
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        reports = gather_object([None if error is None else
                                 f"process {accelerator.process_index}: {type(error).__name__}: {error}"])
        failed = [r for r in reports if r]
        if failed and error is None:
            raise OSError(f"another process failed: {'; '.join(failed)}")
    if error is not None:
        raise error

