"""The trainer's side of weights by broadcast (see rollwire.rollout.weight_group)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from typing import Any

import grpc
import torch

from rollwire.proto.v1 import rollout_pb2
from rollwire.rollout.weight_group import (
    WeightGroup,
    WeightGroupError,
    default_backend,
    open_store,
    tensor_specs,
)

log = logging.getLogger(__name__)


class GroupPublisher:
    """Rank 0 of the weight group, and the gRPC calls that go with each broadcast."""

    def __init__(self, group: WeightGroup, timeout_seconds: float) -> None:
        self.group = group
        self.timeout_seconds = timeout_seconds
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
            raise WeightGroupError(f"the weight group did not form: {_describe(failures[0])}")
        log.info(
            "weight group formed",
            extra={"group_id": group_id, "world_size": world_size, "backend": backend},
        )
        return cls(results[0], timeout_seconds)

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
                f"broadcast of version {version} failed: {_describe(failures[0])}"
            )

    def close(self) -> None:
        self.usable = False
        self.group.close()


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)
