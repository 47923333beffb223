"""Several reward-servers: items go to the servers that serve their domain, a lost server's
items to another, and a Score call's deadline grows with its batch."""

from __future__ import annotations

import asyncio

import pytest

from rollwire.reward.server import registrations
from rollwire.rollout.orchestrator.servers import NoScorer, Servers
from rollwire.services.core.config import RewardServerConfig, RunConfig, ServerConfig
from rollwire.services.core.datasets import Task
from rollwire.services.core.metrics import COUNTERS, GAUGES

SCORERS = """
import time
from rollwire.reward.scorers import Score

def alpha(item):
    return Score(1.0, {"alpha": 1.0})

def beta(item):
    return Score(2.0, {"beta": 1.0})

def slow(item):
    time.sleep(0.4)
    return Score(3.0, {})
"""


@pytest.fixture
async def reward_servers(start_service, tmp_path, monkeypatch):
    """Starts reward-servers with the given custom scorers; returns their runtimes."""
    (tmp_path / "routing_scorers.py").write_text(SCORERS)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit sys.path
    servicers = []

    async def start(*customs: dict[str, str], **settings):
        runtimes = []
        for custom in customs:
            (registration,) = registrations(
                RewardServerConfig(workers=1, custom_scorers=custom, **settings)
            )
            runtimes.append(await start_service([registration], ServerConfig(grace_seconds=0)))
            servicers.append(registration.servicer)
        return runtimes

    yield start
    for servicer in servicers:
        await servicer.close()


def servers_for(addresses: list[str], **client) -> Servers:
    config = RunConfig.model_validate(
        {
            "endpoints": {"reward_servers": addresses, "rollout_servers": []},
            "client": {"connect_timeout_seconds": 10, **client},
        }
    )
    return Servers(config, eos=0)


def task(domain: str) -> Task:
    return Task(0, "t0", "q", "a", domain, "test")


@pytest.mark.integration
async def test_items_go_to_the_servers_that_serve_their_domain(reward_servers) -> None:
    a, b = await reward_servers(
        {"alpha": "routing_scorers:alpha"}, {"beta": "routing_scorers:beta"}
    )
    servers = servers_for([a.address, b.address])
    try:
        await servers.wait_until_serving()
        assert "alpha" in servers.reward[0].domains and "alpha" not in servers.reward[1].domains
        assert [r.reward for r in await servers.score(task("alpha"), ["x", "y"])] == [1.0, 1.0]
        assert [r.reward for r in await servers.score(task("beta"), ["x"])] == [2.0]
        servers.check_domains(["alpha", "beta", "math"])
        with pytest.raises(NoScorer, match=r"domain\(s\) \['gamma'\].*scores \[.*'alpha'"):
            servers.check_domains(["gamma", "beta"])
        with pytest.raises(NoScorer, match="gamma"):
            await servers.score(task("gamma"), ["x"])
    finally:
        await servers.close()


@pytest.mark.integration
async def test_a_lost_reward_servers_items_are_scored_by_another(reward_servers) -> None:
    a, b = await reward_servers({}, {})
    servers = servers_for([a.address, b.address])
    try:
        await servers.wait_until_serving()
        item = ["<answer>a</answer>"]
        first = await servers.score(task("exact_match"), item)
        await a.stop(grace=0)
        failures = COUNTERS.get("orchestrator_reward_server_failures", server=a.address)
        scored = [await servers.score(task("exact_match"), item) for _ in range(4)]
        assert all(r[0].reward == first[0].reward == 1.0 and not r[0].error for r in scored)
        # The first call after the loss met it (equal loads: the first server is chosen)
        # and went on to the other; the later ones passed it over.
        assert COUNTERS.get("orchestrator_reward_server_failures", server=a.address) == failures + 1
        assert servers.reward[0].passed_over_until > 0
    finally:
        await servers.close()


@pytest.mark.integration
async def test_a_score_calls_deadline_leaves_every_item_its_own_limit(reward_servers) -> None:
    """Six 0.4 s items on one worker take 2.4 s: past the 1 s default deadline, within
    ceil(6 / 1) x 1 s + the margin. Meanwhile the items waiting for the worker are the
    server's `reward_waiting_items` gauge (what deploy/k8s's autoscaler reads)."""
    (server,) = await reward_servers({"slow": "routing_scorers:slow"}, item_timeout_seconds=1.0)
    servers = servers_for([server.address], default_timeout_seconds=1.0)
    try:
        await servers.wait_until_serving()
        assert servers.reward[0].parallel_items == 1
        assert servers.reward[0].item_timeout_seconds == 1.0
        waiting: list[float] = []
        scoring = asyncio.ensure_future(servers.score(task("slow"), ["x"] * 6))
        while not scoring.done():
            waiting.append(GAUGES.read()["reward_waiting_items"][0])
            await asyncio.sleep(0.05)
        results = await scoring
        assert [r.reward for r in results] == [3.0] * 6 and not any(r.error for r in results)
        # All six wait while the worker starts, then fewer as each is taken, to none.
        after = waiting[waiting.index(6) :]
        assert after == sorted(after, reverse=True) and after[-1] == 0, waiting
        assert GAUGES.read()["reward_waiting_items"][0] == 0
    finally:
        await servers.close()
