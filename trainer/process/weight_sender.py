"""Everything the trainer sends weights with: gRPC streams, or broadcasts in the weight group.

After each step `publish` sends the new version to every rollout-server at once,
as chunk streams (`UpdateWeights`) or, with `trainer.weights.transport: group`,
by broadcast from rank 0 of the weight group (`GroupPublisher`). A server that
missed a version (it was restarting) is found by `catch_up` and sent the current
one; `served_versions` tells a resuming trainer which versions the servers hold.
The receiving side, and the group itself, are `rollwire.rollout.server.weights`.

The rollout-servers are the run's members now (`RolloutPeers`): one that joins is
behind (it starts from the initial weights) and `catch_up` sends it the current
version; one that leaves is sent nothing more. A weight group is formed once, with
the members of the start: when they change, it is left for good and weights go as
gRPC streams (said and counted in `weight_group_failures`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
import torch

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
from rollwire.rollout.server.weights import (
    WeightGroup,
    WeightGroupError,
    default_backend,
    iter_weight_chunks,
    open_store,
    tensor_specs,
)
from rollwire.services.core.client import describe_error, open_channel, wait_for_serving
from rollwire.services.core.config import RunConfig
from rollwire.services.core.members import Membership
from rollwire.services.core.metrics import COUNTERS

if TYPE_CHECKING:
    from rollwire.trainer.rl.policy import Policy

log = logging.getLogger(__name__)
# A server that answers so is restarting: it misses this version and is caught up later.
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def publish(
    stubs: list[Any],
    policy: Policy,
    version: int,
    chunk_bytes: int,
    timeout: float = 120.0,
    group: GroupPublisher | None = None,
    named: list[tuple[str, torch.Tensor]] | None = None,
) -> float:
    """Sends the weights to every rollout-server at once; returns the seconds it took.

    By broadcast in the weight group when there is one (`trainer.weights.transport:
    group`); if that fails the group is dropped for good and the servers behind get
    the version as gRPC streams. A server that cannot be reached (restarting) is
    skipped and counted; `catch_up` brings it to the current version once it is back.
    `named` sends those tensors instead of the policy's weights as they are now.
    """
    started = time.perf_counter()
    if named is None:  # the weights as they are now (`Policy.weights_snapshot`: a copy)
        named = policy.named_weights()
    if group is not None and group.usable and list(stubs) != group.members:
        COUNTERS.inc("weight_group_failures")
        log.warning("the rollout-servers changed: weights go as gRPC streams from now on")
        group.close()
    if group is not None and group.usable:
        try:
            await group.publish(stubs, named, version)
            return time.perf_counter() - started
        except WeightGroupError as error:
            COUNTERS.inc("weight_group_failures")
            log.warning("weights go as gRPC streams from now on: %s", error)
            await catch_up(stubs, policy, version, chunk_bytes)
            return time.perf_counter() - started
    replies = await asyncio.gather(
        *(
            stub.UpdateWeights(iter_weight_chunks(named, version, chunk_bytes), timeout=timeout)
            for stub in stubs
        ),
        return_exceptions=True,
    )
    for reply in replies:
        if isinstance(reply, grpc.aio.AioRpcError) and reply.code() in _UNREACHABLE:
            COUNTERS.inc("trainer_publish_missed")
            log.warning("a rollout-server missed version %d: %s", version, describe_error(reply))
        elif isinstance(reply, BaseException):
            raise reply
        elif reply.version != version:
            raise RuntimeError(f"a rollout-server took version {reply.version}, not {version}")
    return time.perf_counter() - started


async def catch_up(stubs: list[Any], policy: Policy, version: int, chunk_bytes: int) -> int:
    """Sends the weights to every reachable rollout-server behind `version` (one that was
    restarted starts from the initial weights); returns how many were behind."""
    behind = []
    for stub in stubs:
        try:
            status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            continue  # not back yet: the next round asks again
        if status.policy_version < version:
            behind.append(stub)
    if behind:
        COUNTERS.inc("trainer_catch_ups", amount=len(behind))
        log.info("rollout-servers behind version %d: sending it", version)
        await publish(behind, policy, version, chunk_bytes)
    return len(behind)


async def served_versions(stubs: list[Any]) -> list[int]:
    """The policy versions the reachable rollout-servers hold (for a resuming trainer,
    whose next version must be newer than all of them)."""
    versions = []
    for stub in stubs:
        try:
            status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest(), timeout=5.0)
            versions.append(status.policy_version)
        except grpc.aio.AioRpcError:
            pass  # not up: it gets the weights when it is (catch_up)
    return versions


async def form_weight_group(
    config: RunConfig, policy: Policy, stubs: list[Any]
) -> GroupPublisher | None:
    """The weight group of this trainer and every rollout-server, or None (weights then go
    as gRPC streams) when it does not form."""
    trainer = config.trainer
    try:
        return await GroupPublisher.form(
            stubs,
            trainer.weights.group_address,
            trainer.weights.group_backend,
            trainer.weights.group_timeout_seconds,
            device=trainer.device,
        )
    except WeightGroupError as error:
        COUNTERS.inc("weight_group_failures")
        hint = ""
        if trainer.device.startswith("cuda") and trainer.weights.group_backend != "gloo":
            hint = (
                " (NCCL wants one GPU per member: a trainer and rollout-servers on one device "
                "cannot form a group)"
            )
        log.warning("no weight group, weights go as gRPC streams: %s%s", error, hint)
        return None


class GroupPublisher:
    """Rank 0 of the weight group, and the gRPC calls that go with each broadcast."""

    def __init__(
        self, group: WeightGroup, timeout_seconds: float, members: list[Any] | None = None
    ) -> None:
        self.group = group
        self.timeout_seconds = timeout_seconds
        self.members = list(members or [])
        """The rollout-servers' stubs the group was formed with, in rank order."""
        self.usable = True

    @classmethod
    async def form(
        cls,
        stubs: list[Any],
        address: str,
        backend: str = "auto",
        timeout_seconds: float = 60.0,
        device: str | torch.device = "cpu",
    ) -> GroupPublisher:
        """Opens the rendezvous and has every rollout-server join; WeightGroupError if not all do."""
        backend = default_backend() if backend == "auto" else backend
        world_size = len(stubs) + 1
        group_id = uuid.uuid4().hex[:12]
        store = await asyncio.to_thread(open_store, address, world_size, timeout_seconds)
        request = {
            "address": address,
            "port": store.port,
            "world_size": world_size,
            "backend": backend,
            "group_id": group_id,
            "timeout_seconds": timeout_seconds,
        }
        own = asyncio.to_thread(
            WeightGroup,
            address,
            store.port,
            0,
            world_size,
            backend,
            group_id,
            timeout_seconds,
            device if backend == "nccl" else "cpu",
            store,
        )
        joins = [
            stub.JoinWeightGroup(
                rollout_pb2.JoinWeightGroupRequest(rank=rank, **request),
                timeout=timeout_seconds + 5,
            )
            for rank, stub in enumerate(stubs, start=1)
        ]
        results = await asyncio.gather(own, *joins, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            if isinstance(results[0], WeightGroup):
                results[0].close()
            raise WeightGroupError(f"the weight group did not form: {describe_error(failures[0])}")
        log.info(
            "weight group formed",
            extra={"group_id": group_id, "world_size": world_size, "backend": backend},
        )
        return cls(results[0], timeout_seconds, stubs)

    async def publish(
        self, stubs: list[Any], named: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Broadcasts one version to every member; WeightGroupError (and the group closed)
        if any of them does not take it."""
        named = list(named)
        request = rollout_pb2.ReceiveWeightsRequest(
            version=version,
            group_id=self.group.group_id,
            tensors=[
                rollout_pb2.TensorSpec(name=name, dtype=dtype, shape=shape)
                for name, dtype, shape in tensor_specs(named)
            ],
        )
        calls = [stub.ReceiveWeights(request, timeout=self.timeout_seconds) for stub in stubs]
        results = await asyncio.gather(
            asyncio.to_thread(self.group.send, named), *calls, return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        failures += [
            WeightGroupError(f"a rollout-server took version {r.version}, not {version}")
            for r in results[1:]
            if not isinstance(r, BaseException) and r.version != version
        ]
        if failures:
            self.close()
            raise WeightGroupError(
                f"broadcast of version {version} failed: {describe_error(failures[0])}"
            )

    def close(self) -> None:
        """Leaves the group for good: `publish` sends streams from then on."""
        self.usable = False
        self.group.close()


class RolloutPeers:
    """The rollout-servers the trainer sends weights to: the run's members now
    (`rollwire.services.core.members`), each with its channel."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        endpoints = config.endpoints
        self.membership = Membership(
            "rollout-server",
            endpoints.rollout_servers,
            endpoints.members_file,
            endpoints.refresh_seconds,
        )
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, rollout_pb2_grpc.RolloutServiceStub] = {}
        for address in self.membership.members:
            self._open(address)

    def _open(self, address: str) -> None:
        channel = open_channel(address, self.config.client)
        self._channels[address] = channel
        self._stubs[address] = rollout_pb2_grpc.RolloutServiceStub(channel)

    def stubs(self) -> list[rollout_pb2_grpc.RolloutServiceStub]:
        """The members' stubs, in the order they joined."""
        return list(self._stubs.values())

    async def wait_until_serving(self) -> None:
        """Waits for every member of the start (TimeoutError past the connect timeout)."""
        for address, channel in self._channels.items():
            await wait_for_serving(
                channel, timeout=self.config.client.connect_timeout_seconds, target=address
            )

    async def refresh(self) -> None:
        """Takes in the members that joined (`catch_up` sends them the current version) and
        lets go of those that left."""
        if not self.membership.due():
            return
        change = await asyncio.to_thread(self.membership.refresh)
        for address in change.joined:
            self._open(address)
        for address in change.left:
            self._stubs.pop(address)
            await self._channels.pop(address).close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
