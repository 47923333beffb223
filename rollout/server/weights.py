"""Weights into a rollout-server: a chunk stream over gRPC, or a broadcast in a weight group.

The rollout side's published weight interface: the trainer imports this module (to
cut chunks, to join the group as rank 0) and nothing else of `rollwire.rollout`.
The rollout-server's servicer hands each weight call to a `WeightReceiver` and
maps what it raises to gRPC status codes.

Streams: the sender cuts each tensor's bytes into chunks of at most
`chunk_bytes`, each naming its tensor, dtype, shape, byte offset and total size,
and the new version. The receiver checks every chunk against the parameters it
serves and only hands over a complete, consistent set: a bad stream changes nothing.

The weight group: the trainer opens a rendezvous store (a torch.distributed
`TCPStore`, port picked by the OS), joins as rank 0 and asks each rollout-server
over gRPC to join as rank 1..n (`JoinWeightGroup`). The group is a
`ProcessGroupNCCL` between GPUs or a `ProcessGroupGloo` on CPUs built directly on
that store, so it touches neither process's default process group (the trainer's
FSDP group, say). An update is one `ReceiveWeights` call per server naming the
tensors in order, while rank 0 broadcasts them in that order; each server
receives into fresh tensors on its device and swaps them in as it would a
stream. Only tensors move over the group; the control stays on gRPC, with its
deadlines and errors. A collective cannot lose a member: when a broadcast fails
the trainer drops the group for the rest of the run and sends streams again
(`rollwire.trainer.process.weight_sender`).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import AsyncIterable, Iterable, Iterator
from typing import Protocol

import torch

from rollwire.proto.v1 import rollout_pb2
from rollwire.services.core.metrics import COUNTERS

log = logging.getLogger(__name__)
DTYPE_NAMES = {
    torch.float32: "<f4",
    torch.float16: "<f2",
    torch.bfloat16: "bfloat16",
    torch.float64: "<f8",
}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
BACKENDS = ("gloo", "nccl")


class WeightStreamError(ValueError):
    """Weights that cannot be applied; `code` is the gRPC status name to answer with."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


class WeightGroupError(RuntimeError):
    """The group could not form, or a broadcast in it failed."""


class WeightGroupRequestError(ValueError):
    """A JoinWeightGroup request that names no group one could join."""


class NotInWeightGroup(LookupError):
    """A ReceiveWeights call for a group this rollout-server is not in."""


# Streams: the chunk codec.


def iter_weight_chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[rollout_pb2.WeightChunk]:
    """Cuts tensors into WeightChunk messages of at most `chunk_bytes` of data each."""
    for name, tensor in named_tensors:
        tensor = tensor.detach().contiguous().cpu()
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(
                f"{name}: dtype {tensor.dtype} cannot be sent; use float32, float16 or bfloat16"
            )
        # bfloat16 has no numpy dtype: send its raw 16-bit pattern.
        raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        data = raw.numpy().tobytes()
        total = len(data)
        for offset in range(0, max(total, 1), chunk_bytes):
            yield rollout_pb2.WeightChunk(
                version=version,
                name=name,
                dtype=DTYPE_NAMES[tensor.dtype],
                shape=list(tensor.shape),
                offset=offset,
                data=data[offset : offset + chunk_bytes],
                total_bytes=total,
            )


class WeightAssembler:
    """Collects a chunk stream into tensors, checking it against the served parameters."""

    def __init__(
        self, parameters: dict[str, tuple[tuple[int, ...], torch.dtype]], served_version: int
    ) -> None:
        self._parameters = parameters
        self._served_version = served_version
        self._version: int | None = None
        self._buffers: dict[str, bytearray] = {}
        self._filled: dict[str, int] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.bytes_received = 0

    def add(self, chunk: rollout_pb2.WeightChunk) -> None:
        """Checks one chunk against the served parameters and copies its bytes in."""
        if self._version is None:
            if chunk.version <= self._served_version:
                raise WeightStreamError(
                    f"version {chunk.version} is not newer than the served version {self._served_version}",
                    code="FAILED_PRECONDITION",
                )
            self._version = chunk.version
        elif chunk.version != self._version:
            raise WeightStreamError(
                f"chunk of {chunk.name!r} has version {chunk.version}, the stream began with {self._version}"
            )
        if chunk.name not in self._parameters:
            raise WeightStreamError(
                f"unknown parameter {chunk.name!r}: the served model has no such tensor"
            )
        shape = self._parameters[chunk.name][0]
        if tuple(chunk.shape) != shape:
            raise WeightStreamError(
                f"{chunk.name}: shape {tuple(chunk.shape)} where the model has {shape}"
            )
        if chunk.dtype not in DTYPES:
            raise WeightStreamError(
                f"{chunk.name}: unsupported dtype {chunk.dtype!r} (use {sorted(DTYPES)})"
            )
        itemsize = torch.empty(0, dtype=DTYPES[chunk.dtype]).element_size()
        expected = itemsize * int(torch.Size(shape).numel())
        if chunk.total_bytes != expected:
            raise WeightStreamError(
                f"{chunk.name}: total_bytes {chunk.total_bytes} where {expected} are expected"
            )
        buffer = self._buffers.get(chunk.name)
        if buffer is None:
            buffer = self._buffers[chunk.name] = bytearray(expected)
            self._filled[chunk.name] = 0
            self._meta[chunk.name] = (chunk.dtype, shape)
        elif self._meta[chunk.name][0] != chunk.dtype:
            raise WeightStreamError(f"{chunk.name}: chunks disagree on dtype")
        if chunk.offset != self._filled[chunk.name] or chunk.offset + len(chunk.data) > expected:
            raise WeightStreamError(
                f"{chunk.name}: chunk at offset {chunk.offset} with {len(chunk.data)} bytes does not follow "
                f"the {self._filled[chunk.name]} bytes received (chunks must arrive in order, without gaps)"
            )
        buffer[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
        self._filled[chunk.name] += len(chunk.data)
        self.bytes_received += len(chunk.data)

    def finish(self) -> tuple[dict[str, torch.Tensor], int]:
        """The complete tensors (in the model's dtypes) and the version; raises if anything is missing."""
        if self._version is None:
            raise WeightStreamError("the stream carried no chunks")
        incomplete = sorted(
            name for name, buffer in self._buffers.items() if self._filled[name] != len(buffer)
        )
        if incomplete:
            raise WeightStreamError(f"tensors ended before all their bytes arrived: {incomplete}")
        tensors = {}
        for name, buffer in self._buffers.items():
            dtype_name, shape = self._meta[name]
            dtype = DTYPES[dtype_name]
            if dtype == torch.bfloat16:
                tensor = torch.frombuffer(buffer, dtype=torch.int16).view(torch.bfloat16)
            else:
                tensor = torch.frombuffer(buffer, dtype=dtype)
            tensors[name] = tensor.reshape(shape).to(self._parameters[name][1])
        return tensors, self._version


# The weight group.


def default_backend() -> str:
    """NCCL where this process has a GPU, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class WeightGroup:
    """One member's handle on the group (rank 0: the trainer)."""

    def __init__(
        self,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        group_id: str,
        timeout_seconds: float,
        device: str | torch.device = "cpu",
        store: torch.distributed.Store | None = None,
    ) -> None:
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs a CUDA GPU in this process")
        timeout = datetime.timedelta(seconds=timeout_seconds)
        self.rank, self.world_size = rank, world_size
        self.backend, self.group_id = backend, group_id
        self.device = torch.device(device)
        started = time.perf_counter()
        try:
            if store is None:
                store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
            prefixed = dist.PrefixStore(f"rollwire-weights/{group_id}", store)
            if backend == "gloo":
                self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        except (RuntimeError, ValueError, OSError) as error:
            raise WeightGroupError(
                f"joining weight group {group_id!r} at {address}:{port} as rank {rank} of "
                f"{world_size} ({backend}) failed: {error}"
            ) from error
        self._store = store  # keeps the rendezvous alive as long as the group
        log.info(
            "joined the weight group",
            extra={
                "group_id": group_id,
                "rank": rank,
                "world_size": world_size,
                "backend": backend,
                "seconds": round(time.perf_counter() - started, 3),
            },
        )

    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Rank 0: broadcasts every tensor in order; returns the bytes sent."""
        sent = 0
        for name, tensor in named:
            tensor = tensor.detach().to(self.device).contiguous()
            self._broadcast(tensor, name)
            sent += tensor.numel() * tensor.element_size()
        return sent

    def receive(self, specs: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """Ranks > 0: receives the tensors `specs` names (name, dtype name, shape), in order."""
        tensors = {}
        for name, dtype, shape in specs:
            tensor = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
            self._broadcast(tensor, name)
            tensors[name] = tensor
        return tensors

    def _broadcast(self, tensor: torch.Tensor, name: str) -> None:
        try:
            self.group.broadcast(tensor, 0).wait()
        except RuntimeError as error:
            raise WeightGroupError(f"broadcast of {name} failed: {error}") from error

    def close(self) -> None:
        """Leaves the group (its communicators are freed)."""
        shutdown = getattr(self.group, "shutdown", None) or getattr(self.group, "abort", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError as error:
                log.debug("closing the weight group: %s", error)


def tensor_specs(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int]]]:
    """(name, dtype name, shape) of each tensor, as ReceiveWeights names them."""
    specs = []
    for name, tensor in named:
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"{name}: dtype {tensor.dtype} cannot be sent")
        specs.append((name, DTYPE_NAMES[tensor.dtype], list(tensor.shape)))
    return specs


def open_store(address: str, world_size: int, timeout_seconds: float) -> torch.distributed.Store:
    """The trainer's rendezvous store on `address`, port picked by the OS (`store.port`)."""
    import torch.distributed as dist

    return dist.TCPStore(
        address,
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_seconds),
    )


# The rollout-server's side of every weight call.


class ServedModel(Protocol):
    """What a `WeightReceiver` needs of the engine it updates (every engine has it)."""

    @property
    def version(self) -> int: ...
    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...
    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> float: ...


def join_problem(request: rollout_pb2.JoinWeightGroupRequest) -> str | None:
    """What is wrong with a JoinWeightGroup request, or None when it names a group one could join."""
    if not request.address or not 0 < request.port < 65536:
        return "address and port (1-65535) of the rendezvous store are required"
    if not 2 <= request.world_size <= 4096 or not 0 < request.rank < request.world_size:
        return f"rank {request.rank} of {request.world_size}: need 0 < rank < world_size"
    if request.backend not in BACKENDS or not request.group_id:
        return f"backend must be one of {BACKENDS} and group_id set"
    if not 0 < request.timeout_seconds <= 3600:
        return "timeout_seconds must lie in (0, 3600]"
    return None


class WeightReceiver:
    """Takes the trainer's weights into one engine: streams, group membership, broadcasts.

    Each call either swaps a whole new version in or raises, leaving the engine as it
    was: WeightStreamError (bad chunks or tensor specs; its `code`), ValueError from
    the engine (a concurrent update got there first), UpdateUnsupported (the engine
    takes no weights), WeightGroupRequestError, WeightGroupError, NotInWeightGroup.
    """

    def __init__(self, engine: ServedModel) -> None:
        self.engine = engine
        self.group: WeightGroup | None = None  # this server's membership, once it joined one

    async def take_stream(
        self, chunks: AsyncIterable[rollout_pb2.WeightChunk]
    ) -> rollout_pb2.UpdateWeightsResponse:
        """Assembles an UpdateWeights stream and applies it as one version."""
        started = time.perf_counter()
        assembler = WeightAssembler(self.engine.parameter_specs(), self.engine.version)
        async for chunk in chunks:
            assembler.add(chunk)
        tensors, version = assembler.finish()
        apply_seconds = await self.engine.update_weights(tensors, version)
        COUNTERS.inc("rollout_weight_updates")
        log.info(
            "weights updated",
            extra={
                "version": version,
                "tensors": len(tensors),
                "bytes": assembler.bytes_received,
                "seconds": round(time.perf_counter() - started, 4),
            },
        )
        return rollout_pb2.UpdateWeightsResponse(
            version=version,
            bytes_received=assembler.bytes_received,
            tensors=len(tensors),
            apply_seconds=apply_seconds,
        )

    async def join(self, request: rollout_pb2.JoinWeightGroupRequest) -> WeightGroup:
        """Joins the group the trainer formed (leaving any group joined before)."""
        problem = join_problem(request)
        if problem is not None:
            raise WeightGroupRequestError(problem)
        device = "cpu" if request.backend == "gloo" else str(getattr(self.engine, "device", "cuda"))
        if self.group is not None:
            self.group.close()
            self.group = None
        self.group = await asyncio.to_thread(
            WeightGroup,
            request.address,
            request.port,
            request.rank,
            request.world_size,
            request.backend,
            request.group_id,
            request.timeout_seconds,
            device,
        )
        COUNTERS.inc("rollout_weight_groups_joined")
        return self.group

    async def receive(
        self, request: rollout_pb2.ReceiveWeightsRequest
    ) -> rollout_pb2.UpdateWeightsResponse:
        """Takes part in the broadcast of one version and applies it."""
        group = self.group
        if group is None or request.group_id != group.group_id:
            raise NotInWeightGroup(
                f"this rollout-server is not in weight group {request.group_id!r}"
            )
        served = self.engine.parameter_specs()
        specs, problem = [], None
        for tensor in request.tensors:
            if tensor.name not in served or tuple(tensor.shape) != served[tensor.name][0]:
                problem = f"{tensor.name}: not a parameter of the served model with that shape"
            elif tensor.dtype not in DTYPES:
                problem = f"{tensor.name}: unsupported dtype {tensor.dtype!r}"
            specs.append((tensor.name, tensor.dtype, tuple(tensor.shape)))
        if problem is not None or not specs:
            # Not taking part breaks the broadcast for everyone: leave the group.
            group.close()
            self.group = None
            raise WeightStreamError(problem or "no tensors")
        started = time.perf_counter()
        try:
            tensors = await asyncio.to_thread(group.receive, specs)
        except WeightGroupError:
            group.close()
            self.group = None
            raise
        tensors = {name: t.to(served[name][1]) for name, t in tensors.items()}
        apply_seconds = await self.engine.update_weights(tensors, request.version)
        COUNTERS.inc("rollout_weight_updates")
        received = sum(t.numel() * t.element_size() for t in tensors.values())
        log.info(
            "weights received by broadcast",
            extra={
                "version": request.version,
                "tensors": len(tensors),
                "bytes": received,
                "seconds": round(time.perf_counter() - started, 4),
            },
        )
        return rollout_pb2.UpdateWeightsResponse(
            version=request.version,
            bytes_received=received,
            tensors=len(tensors),
            apply_seconds=apply_seconds,
        )

    def close(self) -> None:
        """Leaves the weight group, if in one."""
        if self.group is not None:
            self.group.close()
            self.group = None
