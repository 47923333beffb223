"""Cache entries built by several processes at once: built once, never replaced under a reader."""

from __future__ import annotations

import threading
import time

import pytest

from rollwire.services.core.files import building, staged_directory


def test_the_second_builder_of_a_cache_entry_waits_and_finds_it_built(tmp_path) -> None:
    folder = tmp_path / "warm-abc"
    holding, order = threading.Event(), []

    def first() -> None:
        with building(folder, "config.json") as ready:
            order.append(("first", ready))
            holding.set()
            time.sleep(0.3)  # the second one asks meanwhile
            with staged_directory(folder, keep_if_present="config.json") as staging:
                staging.mkdir()
                (staging / "config.json").write_text("{}")

    thread = threading.Thread(target=first)
    thread.start()
    assert holding.wait(5)
    with building(folder, "config.json") as ready:
        order.append(("second", ready))
    thread.join(5)
    assert order == [("first", False), ("second", True)]


def test_a_builder_that_never_finishes_is_waited_for_only_so_long(tmp_path) -> None:
    folder = tmp_path / "warm-abc"
    with (
        building(folder, "config.json"),
        pytest.raises(TimeoutError, match="another process"),
        building(folder, "config.json", timeout=0.3),
    ):
        pass


def test_an_entry_finished_meanwhile_is_kept_and_the_late_copy_dropped(tmp_path) -> None:
    folder = tmp_path / "tiny-abc"
    with staged_directory(folder, keep_if_present="marker") as late:
        late.mkdir()
        (late / "marker").write_text("late")
        folder.mkdir()  # another process finished the same entry first
        (folder / "marker").write_text("early")
    assert (folder / "marker").read_text() == "early"
    assert not late.exists()
    # Without keep_if_present the newest replaces it, as before.
    with staged_directory(folder) as newest:
        newest.mkdir()
        (newest / "marker").write_text("newest")
    assert (folder / "marker").read_text() == "newest"
