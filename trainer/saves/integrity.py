"""A save's faults: one that cannot be written, and one that is not whole when a run resumes.

Writing: DCP raises what the file system said, wrapped per rank in a CheckpointException;
`SaveError` says in one line which save could not be written where, and why (the OS's words and
path). The half-written `.tmp_step_*` directory is never a save (trainer/saves/dcp.py), so the
saves before it stay the ones a resume finds.

Resuming: whether a save is whole, its files against what DCP's `.metadata` says. A save is renamed into place only once every rank's data and the metadata are written, so a
kill during a save never leaves a broken one. A disk that fills up later, a copy cut short, a
file system that lost a file, or a hand-edited directory can. DCP reads such a save only as far
as it must and fails inside the ranks (or, for a file cut short past what a rank reads, never):
this check finds it in the job process instead, from the metadata alone. DCP's FileSystemWriter
writes each `.distcp` file as its items back to back, so a file's size is exactly the end of its
last item; the metadata records each item's file, offset and length (DCP keeps no checksum).
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

from trainer.console import one_line

DATA_SUFFIX = ".distcp"


class SaveError(RuntimeError):
    """A save could not be written; the message is one line naming the save, the path and the OS's reason."""


def save_error(err: BaseException, root: Path, step: int) -> SaveError:
    """The one-line error for a save of `step` under `root` that failed with `err` (as DCP raised it)."""
    return SaveError(
        f"could not write the save of step {step} under {root} ({reason(err)}); the earlier saves are intact"
    )


def prepare_error(err: BaseException, root: Path) -> SaveError:
    """The one-line error for the preparation of background saves (trainer/saves/background.py) that failed."""
    return SaveError(f"could not prepare the background saves under {root} ({reason(err)})")


def reason(err: BaseException) -> str:
    """The OS's words and path where the file system failed, else the error's first line."""
    cause = os_error(err)
    if isinstance(cause, OSError) and cause.strerror:
        return f"{cause.strerror}: {cause.filename}" if cause.filename else cause.strerror
    return one_line(cause)


def os_error(err: BaseException) -> BaseException:
    """The file system's own error inside `err`: DCP keeps each rank's exception in a
    CheckpointException's `failures` ({rank: exception or (exception, traceback)})."""
    pending = [err]
    while pending:
        current = pending.pop(0)
        if isinstance(current, OSError):
            return current
        for failure in (getattr(current, "failures", None) or {}).values():
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return err


def save_problem(path: Path) -> str | None:
    """None when every file the metadata names is there at its full size and no other data file is; else why not."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # unreadable, cut short, or not DCP's: any of these means not whole
        return f".metadata cannot be read ({type(err).__name__})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if (size := file.stat().st_size) != end:
            return f"{name} is {size} bytes; .metadata says {end}"
    unlisted = sorted(p.name for p in path.glob(f"*{DATA_SUFFIX}") if p.name not in ends)
    if unlisted:
        return f".metadata does not list {', '.join(unlisted)} (files of another save?)"
    return None


def newest_whole_save(saves: list[Path], say: bool = True) -> Path | None:
    """The newest of `saves` (oldest first) that is whole; each newer broken one is named, with why, once."""
    for path in reversed(saves):
        problem = save_problem(path)
        if problem is None:
            return path
        if say:
            print(f"resume: skipping {path}: {problem}", flush=True)
    return None
