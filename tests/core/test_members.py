"""A role's members from a source that changes: the members file, DNS names looked up
again, and a source that cannot be read for a moment."""

from __future__ import annotations

import pytest

from rollwire.services.app.scale import ScaleError, parse_changes
from rollwire.services.core.members import Membership, write_members


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_members_file_replaces_the_list_and_changes_are_seen_when_due(tmp_path) -> None:
    path, clock = tmp_path / "members.json", Clock()
    write_members(path, {"rollout-server": ["a:1"], "env-server": ["e:1"]})
    rollout = Membership("rollout-server", ["static:1"], path, refresh_seconds=5, clock=clock)
    reward = Membership("reward-server", ["r:1"], path, refresh_seconds=5, clock=clock)
    assert rollout.members == ["a:1"] and reward.members == ["r:1"]  # the file names no reward

    write_members(path, {"rollout-server": ["a:1", "b:1"], "env-server": ["e:1"]})
    assert not rollout.refresh()  # not due yet
    clock.now = 5.0
    change = rollout.refresh()
    assert (change.joined, change.left) == (["b:1"], [])
    write_members(path, {"rollout-server": ["b:1"]})
    clock.now = 10.0
    change = rollout.refresh()
    assert (change.joined, change.left) == ([], ["a:1"]) and rollout.members == ["b:1"]
    assert not reward.refresh(force=True)

    path.write_text("{half a file")  # unreadable: the members stay as they were
    clock.now = 15.0
    assert not rollout.refresh() and rollout.members == ["b:1"]


def test_a_dns_name_is_looked_up_again_and_a_failed_lookup_keeps_the_members() -> None:
    answers = {"envs": ["10.0.0.1:7", "10.0.0.2:7"]}

    def resolve(host: str, port: int) -> list[str]:
        if host not in answers:
            raise ValueError(f"cannot resolve name {host!r}")
        return answers[host]

    clock = Clock()
    envs = Membership("env-server", ["dns:///envs:7"], None, 1.0, resolve, clock)
    assert envs.members == ["10.0.0.1:7", "10.0.0.2:7"] and envs.changes_over_time
    answers["envs"] = ["10.0.0.2:7", "10.0.0.3:7"]  # a replica replaced
    clock.now = 1.0
    change = envs.refresh()
    assert (change.joined, change.left) == (["10.0.0.3:7"], ["10.0.0.1:7"])
    del answers["envs"]
    clock.now = 2.0
    assert not envs.refresh() and envs.members == ["10.0.0.2:7", "10.0.0.3:7"]
    static = Membership("rollout-server", ["h:1"], None, 1.0, resolve, clock)
    assert not static.changes_over_time and not static.due()


def test_scale_changes_are_signed_counts_of_a_known_role() -> None:
    assert parse_changes(["rollout-server=+2", "env-server=-1", "rollout-server=-1"]) == {
        "rollout-server": 1,
        "env-server": -1,
    }
    for bad, why in (
        ("trainer=+1", "the role must be one of"),
        ("rollout-server=2", "signed count"),
        ("rollout-server=+x", "signed count"),
        ("rollout-server=+0", "signed count"),
    ):
        with pytest.raises(ScaleError, match=why):
            parse_changes([bad])
    with pytest.raises(ScaleError, match="nothing to change"):
        parse_changes([])
