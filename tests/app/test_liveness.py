"""The launcher says when a service of a run stops answering (frozen with SIGSTOP here),
for how long and what the run does meanwhile, and again when it answers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rollwire.services.app.liveness import Liveness, Target
from rollwire.services.core.metrics import COUNTERS
from tests.conftest import ROLLWIRE


def said_within(lines: list[str], words: str, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for line in lines:
            if words in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"nothing said {words!r} within {seconds}s; said: {lines}")


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["env-server", "buffer"])
def test_a_frozen_service_is_named_while_it_lasts_and_when_it_answers_again(
    spawn, tmp_path, kind
) -> None:
    ready = tmp_path / f"{kind}.ready"
    args = [*ROLLWIRE, kind, "--ready-file", str(ready)]
    if kind == "buffer":
        args += ["--set", f"run.output_dir={tmp_path / 'run'}"]
    else:
        args += ["--port", "0"]
    child = spawn(args)
    address = child.wait_for_file(ready, timeout=60)
    lines: list[str] = []
    target = Target(kind, kind, address)
    watch = Liveness(lambda: [target], lines.append, every=0.2, after_seconds=1.0, timeout=0.5)
    before = COUNTERS.get("launcher_unresponsive", service=kind)
    watch.start()
    try:
        time.sleep(0.6)
        assert lines == []  # a service that answers is not mentioned
        os.kill(child.process.pid, signal.SIGSTOP)
        try:
            line = said_within(lines, "has not answered", 10)
        finally:
            os.kill(child.process.pid, signal.SIGCONT)
        assert line.startswith(kind) and "meanwhile" in line
        assert ("nothing is lost" if kind == "buffer" else "restart on another") in line
        again = said_within(lines, "answers again", 10)
        assert again.startswith(f"{kind} answers again, after ")
        assert len([x for x in lines if "has not answered" in x]) == 1  # said once, not per check
        assert COUNTERS.get("launcher_unresponsive", service=kind) == before + 1
    finally:
        watch.stop()
    code, _, err = child.terminate()
    assert code == 0, err
