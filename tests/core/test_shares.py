"""Dataset mixtures and batches composed by domain (or source) with fixed shares."""

from __future__ import annotations

import pytest

from rollwire.services.buffer.state import BufferState
from rollwire.services.core.config import RunConfig
from rollwire.services.core.datasets import MixtureTasks, Task
from tests.helpers.trajectories import trajectory


def tasks(name: str, count: int, domain: str = "math") -> list[Task]:
    return [Task(i, f"{name}/{i}", f"q{i}", "a", domain, name) for i in range(count)]


def test_a_mixture_interleaves_its_parts_evenly_by_weight() -> None:
    mixture = MixtureTasks([(tasks("a", 10), 2), (tasks("b", 4), 1)])
    assert len(mixture) == 12  # four rounds of 3: part b runs out first
    assert [t.source for t in mixture][:6] == ["a", "b", "a", "a", "b", "a"]
    assert [t.task_id for t in mixture][:3] == ["p0:a/0", "p1:b/0", "p0:a/1"]
    assert [t.ordinal for t in mixture] == list(range(12))
    assert sorted(t.task_id for t in mixture if t.source == "a") == sorted(
        f"p0:a/{i}" for i in range(8)
    )
    with pytest.raises(ValueError, match="fewer tasks than its weight"):
        MixtureTasks([(tasks("a", 1), 2)])


def mixture_config(**shares: int) -> dict:
    return {
        "rl": {"groups_per_step": 3},
        "orchestrator": {
            "dataset": {
                "type": "mixture",
                "parts": [
                    {"weight": 2, "dataset": {"name": "chain_sum"}},
                    {"weight": 1, "dataset": {"name": "basic_arithmetic"}},
                ],
            }
        },
        "buffer": {"share_by": "source", "batch_shares": shares},
    }


def test_shares_must_fill_the_batch_and_match_the_mixture() -> None:
    config = RunConfig.model_validate(mixture_config(chain_sum=2, basic_arithmetic=1))
    assert config.buffer.batch_shares == {"chain_sum": 2, "basic_arithmetic": 1}
    with pytest.raises(ValueError, match="add up to 4, but a batch holds"):
        RunConfig.model_validate(mixture_config(chain_sum=3, basic_arithmetic=1))
    with pytest.raises(ValueError, match="do not match what the orchestrator's dataset"):
        RunConfig.model_validate(mixture_config(chain_sum=1, basic_arithmetic=2))
    by_domain = mixture_config(reasoning_gym=3)
    by_domain["buffer"]["share_by"] = "domain"
    assert RunConfig.model_validate(by_domain).buffer.batch_shares == {"reasoning_gym": 3}


def put_group(state: BufferState, name: str, domain: str, version: int = 0) -> None:
    for index in range(state.group_size):
        t = trajectory(name, index, version)
        t.domain = domain
        assert state.put(t) == (True, "ok")


def test_batches_take_each_domain_s_share_oldest_first() -> None:
    state = BufferState(group_size=2, max_staleness=0, shares={"math": 2, "code": 1})
    put_group(state, "m1", "math")
    put_group(state, "c1", "code")
    assert state.take(3) is None  # math is one short: nothing is taken
    put_group(state, "m2", "math")
    put_group(state, "m3", "math")
    put_group(state, "c2", "code")
    batch = state.take(3)
    assert [t.group_id for t in batch.trajectories[::2]] == ["m1", "m2", "c1"]
    assert [g[0].group_id for g in state.ready] == ["m3", "c2"]
    stray = trajectory("p1", 0)
    stray.domain = "poetry"
    accepted, reason = state.put(stray)
    assert not accepted and reason.startswith("domain 'poetry' has no share")


def test_stale_groups_do_not_fill_a_share() -> None:
    state = BufferState(group_size=2, max_staleness=0, shares={"math": 1, "code": 1})
    put_group(state, "old", "math", version=0)
    put_group(state, "c", "code", version=1)
    put_group(state, "new", "math", version=1)
    state.trainer_version = 1
    batch = state.take(2)
    assert [t.group_id for t in batch.trajectories[::2]] == ["new", "c"]
    assert state.dropped == {"stale": 2} and state.ledger.outcomes == {"stale": 1}


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_short_run_on_a_mixture_trains_batches_in_their_shares(tmp_path) -> None:
    import json

    from tests.helpers.runs import SHORT_RUN, jsonl, rollwire_train

    sums = tmp_path / "sums.jsonl"
    rows = [
        {"prompt": f"{a} + {b}", "expression": f"{a} + {b}", "answer": str(a + b)}
        for a in range(10)
        for b in range(10)
    ]
    sums.write_text("".join(json.dumps(row) + "\n" for row in rows))
    mixture = (
        "{type: mixture, parts: [{weight: 3, dataset: {type: reasoning_gym}}, "
        f"{{weight: 1, dataset: {{type: file, path: {sums}, domain: math}}}}]}}"
    )
    run_dir, result = rollwire_train(
        tmp_path,
        *SHORT_RUN,
        f"orchestrator.dataset={mixture}",
        "buffer.batch_shares={reasoning_gym: 3, math: 1}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [r for r in jsonl(run_dir / "metrics" / "trained_ids.jsonl") if "step" in r]
    assert len(steps) == 4
    for step in steps:
        parts = [i.split(":", 1)[0] for i in step["ids"]]
        assert (parts.count("p0"), parts.count("p1")) == (12, 4), step["ids"]
