"""Writing files and folders so that readers see all of them or none, and where
rollwire caches what it builds. Imports neither torch nor grpc."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
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


def staging_folder(folder: Path) -> Path:
    """Where to write `folder` before it is put in place whole (`.<name>.<pid>.tmp`
    beside it, cleared, not made): `staged_directory`'s, and the trainer's background
    checkpoints'."""
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    return staging


@contextlib.contextmanager
def staged_directory(folder: Path, keep_if_present: str | None = None) -> Iterator[Path]:
    """Yields an empty staging folder; on success it replaces `folder` whole, on error it is removed.

    A crash while writing leaves the previous `folder` (if any) as it was. With
    `keep_if_present` (a file name) a `folder` that holds that file when the staging is done
    is kept and the staging dropped: for a cache entry keyed by everything that makes it,
    which another process may have built meanwhile and may be reading.
    """
    staging = staging_folder(folder)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if keep_if_present is not None and (folder / keep_if_present).exists():
        shutil.rmtree(staging, ignore_errors=True)
        return
    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.replace(staging, folder)
    except OSError:
        # Another process put its folder there between the two calls above: with
        # `keep_if_present` that one is as good as ours.
        if keep_if_present is None or not (folder / keep_if_present).exists():
            raise
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def building(folder: Path, marker: str, timeout: float = 3600.0) -> Iterator[bool]:
    """Held while a cache entry `folder` is built; yields whether it is there already
    (holding `marker`), built meanwhile by a process that held this before. Two runs that
    want the same warm model build it once: the second waits for the first, at most
    `timeout` seconds (then TimeoutError), instead of computing it again beside it."""
    lock_path = folder.with_name(f".{folder.name}.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{folder} is being built by another process for over {timeout:.0f}s "
                        f"(its lock: {lock_path})"
                    ) from None
                time.sleep(0.2)
        try:
            yield (folder / marker).exists()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete trainer checkpoint of a run (they are written atomically)."""
    folders = sorted((Path(run_dir) / "checkpoints").glob("step_*"))
    complete = [f for f in folders if (f / "trainer_state.pt").exists()]
    return complete[-1] if complete else None


def remove_unfinished_checkpoints(run_dir: Path) -> list[Path]:
    """Removes the staging folders of checkpoints a trainer did not finish writing (it
    died mid-write: `.step_*` beside the `step_*` folders); returns what it removed. Only
    for a trainer starting up: no write of its run is in flight then."""
    removed = []
    for staging in sorted((Path(run_dir) / "checkpoints").glob(".step_*")):
        if staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging)
    return removed


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines log another process may be writing: none when it does
    not exist yet, and up to (not including) a last line still being written."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written right now (or cut short by a crash)
    return rows


def served_address(log: Path) -> str | None:
    """The address of the newest "serving" line of a service's JSON log."""
    if not log.exists():
        return None
    address = None
    for line in log.read_text(errors="replace").splitlines():
        if '"msg": "serving"' in line:
            with contextlib.suppress(json.JSONDecodeError):
                address = json.loads(line).get("address", address)
    return address
