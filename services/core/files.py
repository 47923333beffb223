"""Writing files and folders so that readers see all of them or none, and where
rollwire caches what it builds. Imports neither torch nor grpc."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """$ROLLWIRE_CACHE_DIR, or ~/.cache/rollwire: built models and warm-ups live here."""
    return Path(os.environ.get("ROLLWIRE_CACHE_DIR") or Path.home() / ".cache" / "rollwire")


def write_atomically(path: Path, text: str) -> None:
    """Writes `text` so that readers see either nothing or all of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


@contextlib.contextmanager
def staged_directory(folder: Path) -> Iterator[Path]:
    """Yields an empty staging folder; on success it replaces `folder` whole, on error it is removed.

    A crash while writing leaves the previous `folder` (if any) as it was.
    """
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(staging, folder)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete trainer checkpoint of a run (they are written atomically)."""
    folders = sorted((Path(run_dir) / "checkpoints").glob("step_*"))
    complete = [f for f in folders if (f / "trainer_state.pt").exists()]
    return complete[-1] if complete else None
