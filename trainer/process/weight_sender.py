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
    Encoded,
    WeightGroup,
    WeightGroupError,
    default_backend,
    encode_adapters,
    encode_update,
    iter_encoded_chunks,
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
# A server that answers a delta so does not hold its base, or got other bytes: sent whole.
_DELTA_REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS)


class Deltas:
    """`trainer.weights.deltas`: the last version sent (its bytes, on the CPU) and the
    version each rollout-server acknowledged. A server that holds the last version is
    sent the next one as the bytes that changed (`encode_update`); any other whole.
    Every tensor carries its SHA-256, checked on arrival."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] | None = None
        self.base_version = 0
        self.held: dict[Any, int] = {}
        """stub -> the version it acknowledged (streams with keep_base)."""
        self.bytes_sent = 0
        self.bytes_whole = 0
        """Of the last publish: bytes sent, and what whole streams would have been."""

    def encodings(
        self, named: list[tuple[str, torch.Tensor]], stubs: list[Any]
    ) -> tuple[list[Encoded] | None, list[Encoded] | None]:
        """(the delta encoding if any stub holds the base, the whole one if any does not)."""
        at_base = [
            s for s in stubs if self.base is not None and self.held.get(s) == self.base_version
        ]
        delta = encode_update(named, self.base, checksums=True) if at_base else None
        whole = encode_update(named, checksums=True) if len(at_base) < len(stubs) else None
        return delta, whole

    def remember(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        self.base = {name: t.detach().to("cpu", copy=True) for name, t in named}
        self.base_version = version


class Adapters:
    """`trainer.weights.adapters`: a LoRA run sends each version as its adapted layers'
    adapters alone (`encode_adapters`), each layer's frozen base along with them to a
    server not known to hold it; the server merges them. The frozen weights never
    change, so nothing else travels after the first version a server gets."""

    def __init__(self) -> None:
        self.held: set[Any] = set()
        """Stubs that took a stream with the bases."""
        self.base_version = 0
        """The version the bases were first sent with."""
        self.bytes_sent = 0
        self.bytes_whole = 0


async def _publish_adapters(
    stubs: list[Any],
    policy: Policy,
    version: int,
    chunk_bytes: int,
    timeout: float,
    named: list[tuple[str, torch.Tensor]],
    adapters: Adapters,
) -> None:
    """Adapters alone to the servers that hold the bases, with the bases to the others;
    a server that refuses (it lost them: restarted) gets them with the bases."""
    layers = await asyncio.to_thread(policy.named_adapters)
    adapters.base_version = adapters.base_version or version
    held = [s for s in stubs if s in adapters.held]
    light = (
        await asyncio.to_thread(encode_adapters, layers, False, adapters.base_version)
        if held
        else None
    )
    full = (
        await asyncio.to_thread(encode_adapters, layers, True, adapters.base_version)
        if len(held) < len(stubs)
        else None
    )
    plan = {stub: (light if stub in adapters.held else full) for stub in stubs}
    taken, refused = await _send(
        stubs, plan, version, chunk_bytes, timeout, adapters.base_version, set(held), False
    )
    if refused:
        COUNTERS.inc("trainer_adapters_refused", amount=len(refused))
        log.warning(
            "%d rollout-server(s) refused adapters: sending version %d with the bases",
            len(refused),
            version,
        )
        adapters.held -= set(refused)
        if full is None:
            full = await asyncio.to_thread(encode_adapters, layers, True, adapters.base_version)
        retaken, _ = await _send(
            refused, dict.fromkeys(refused, full), version, chunk_bytes, timeout, keep_base=False
        )
        taken += retaken
    adapters.held |= set(taken)
    adapters.bytes_sent = _bytes_sent(plan, refused, full)
    adapters.bytes_whole = len(stubs) * sum(t.numel() * t.element_size() for _, t in named)


async def publish(
    stubs: list[Any],
    policy: Policy,
    version: int,
    chunk_bytes: int,
    timeout: float = 120.0,
    group: GroupPublisher | None = None,
    named: list[tuple[str, torch.Tensor]] | None = None,
    deltas: Deltas | None = None,
    adapters: Adapters | None = None,
) -> float:
    """Sends the weights to every rollout-server at once; returns the seconds it took.

    By broadcast in the weight group when there is one (`trainer.weights.transport:
    group`); if that fails the group is dropped for good and the servers behind get
    the version as gRPC streams. A server that cannot be reached (restarting) is
    skipped and counted; `catch_up` brings it to the current version once it is back.
    `named` sends those tensors instead of the policy's weights as they are now.
    With `deltas`, a server that holds the last version gets only the bytes that
    changed; one that refuses them (it does not hold that version, or a checksum
    failed) is counted in `trainer_deltas_refused` and sent the version whole. With
    `adapters` (a LoRA run), the adapted layers' adapters alone (`Adapters`).
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
    if adapters is not None:
        await _publish_adapters(stubs, policy, version, chunk_bytes, timeout, named, adapters)
        return time.perf_counter() - started
    if deltas is None:  # each stream cuts its chunks as it goes: no copy of the whole model
        replies = await asyncio.gather(
            *(
                stub.UpdateWeights(iter_weight_chunks(named, version, chunk_bytes), timeout=timeout)
                for stub in stubs
            ),
            return_exceptions=True,
        )
        _taken(stubs, replies, version)
        return time.perf_counter() - started
    named = list(named)
    delta, whole = await asyncio.to_thread(deltas.encodings, named, list(stubs))
    at_base = {s for s in stubs if delta is not None and deltas.held.get(s) == deltas.base_version}
    plan = {stub: (delta if stub in at_base else whole) for stub in stubs}
    taken, refused = await _send(
        stubs, plan, version, chunk_bytes, timeout, deltas.base_version, at_base
    )
    if refused:
        COUNTERS.inc("trainer_deltas_refused", amount=len(refused))
        log.warning(
            "%d rollout-server(s) refused a delta: sending version %d whole", len(refused), version
        )
        if whole is None:
            whole = await asyncio.to_thread(encode_update, named, None, True)
        retaken, _ = await _send(
            refused, {s: whole for s in refused}, version, chunk_bytes, timeout
        )
        taken += retaken
    for stub in taken:
        deltas.held[stub] = version
    deltas.bytes_sent = _bytes_sent(plan, refused, whole)
    deltas.bytes_whole = len(stubs) * sum(t.numel() * t.element_size() for _, t in named)
    await asyncio.to_thread(deltas.remember, named, version)
    return time.perf_counter() - started


def _bytes_sent(
    plan: dict[Any, list[Encoded] | None], refused: list[Any], resent: list[Encoded] | None
) -> int:
    """The bytes a publish streamed: every server's first encoding (a refused one too:
    it went over the wire), and the full form sent again to those that refused it."""
    first = sum(len(e.data) for encoded in plan.values() for e in encoded or [])
    return first + len(refused) * sum(len(e.data) for e in resent or [])


async def _send(
    stubs: list[Any],
    plan: dict[Any, list[Encoded] | None],
    version: int,
    chunk_bytes: int,
    timeout: float,
    base_version: int = 0,
    delta_to: set[Any] | frozenset[Any] = frozenset(),
    keep_base: bool = True,
) -> tuple[list[Any], list[Any]]:
    """Streams each stub its encoding (`delta_to`'s as a delta on `base_version`), each
    stream asking its receiver to keep the bytes as the next delta's base unless not
    `keep_base`; returns (the stubs that took the version, those that refused a delta)."""
    replies = await asyncio.gather(
        *(
            stub.UpdateWeights(
                iter_encoded_chunks(
                    plan[stub] or [],
                    version,
                    chunk_bytes,
                    base_version if stub in delta_to else 0,
                    keep_base=keep_base,
                ),
                timeout=timeout,
            )
            for stub in stubs
        ),
        return_exceptions=True,
    )
    return _taken(stubs, replies, version, delta_to)


def _taken(
    stubs: list[Any],
    replies: list[Any],
    version: int,
    delta_to: set[Any] | frozenset[Any] = frozenset(),
) -> tuple[list[Any], list[Any]]:
    """(the stubs whose reply took `version`, those of `delta_to` that refused a delta).
    Unreachable servers are counted and left to `catch_up`; any other failure raises."""
    taken, refused = [], []
    for stub, reply in zip(stubs, replies, strict=True):
        if isinstance(reply, grpc.aio.AioRpcError) and reply.code() in _UNREACHABLE:
            COUNTERS.inc("trainer_publish_missed")
            log.warning("a rollout-server missed version %d: %s", version, describe_error(reply))
        elif (
            isinstance(reply, grpc.aio.AioRpcError)
            and stub in delta_to
            and reply.code() in _DELTA_REFUSED
        ):
            log.warning("a rollout-server refused a delta: %s", describe_error(reply))
            refused.append(stub)
        elif isinstance(reply, BaseException):
            raise reply
        elif reply.version != version:
            raise RuntimeError(f"a rollout-server took version {reply.version}, not {version}")
        else:
            taken.append(stub)
    return taken, refused


async def catch_up(
    stubs: list[Any],
    policy: Policy,
    version: int,
    chunk_bytes: int,
    deltas: Deltas | None = None,
) -> int:
    """Sends the weights to every reachable rollout-server behind `version` (one that was
    restarted, or joined, starts from the initial weights); returns how many were behind.
    With `deltas` they are sent whole and kept as the base of the next delta."""
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
        if deltas is None:
            await publish(behind, policy, version, chunk_bytes)
        else:
            whole = await asyncio.to_thread(encode_update, policy.named_weights(), None, True)
            taken, _ = await _send(
                behind, dict.fromkeys(behind, whole), version, chunk_bytes, 120.0
            )
            for stub in taken:
                deltas.held[stub] = version
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
        self.membership = Membership.of("rollout-server", endpoints)
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
