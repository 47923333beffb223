"""Writes tests/file_seconds.json, each test file's seconds, from the JUnit report of a
whole run (the order `tests/conftest.py` hands files to the workers in):

    .venv/bin/python -m pytest -n 2 --dist loadfile --junitxml=/tmp/run.xml
    .venv/bin/python tests/helpers/file_seconds.py /tmp/run.xml

It prints the two-worker time of the files in that order against the sum over two."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TARGET = Path(__file__).resolve().parents[1] / "file_seconds.json"


def main(report: str) -> None:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = next(i for i, part in enumerate(parts) if part.startswith("test_"))
        seconds["/".join(parts[: module + 1]) + ".py"] += float(case.get("time", 0))
    ordered = dict(
        sorted(((name, round(s, 1)) for name, s in seconds.items()), key=lambda kv: -kv[1])
    )
    TARGET.write_text(json.dumps(ordered, indent=1) + "\n")
    workers = [0.0, 0.0]
    for cost in ordered.values():
        workers[workers.index(min(workers))] += cost
    print(
        f"{len(ordered)} files, {sum(seconds.values()):.0f} s in all: two workers "
        f"{max(workers):.0f} s, against {sum(seconds.values()) / 2:.0f} s evenly split"
    )


if __name__ == "__main__":
    main(sys.argv[1])
