"""Weights into a rollout-server: a chunk stream over gRPC, or a broadcast in a weight group.

The rollout side's published weight interface: the trainer imports this module (to
cut chunks, to join the group as rank 0) and nothing else of `rollwire.rollout`.
The rollout-server's servicer hands each weight call to a `WeightReceiver` and
maps what it raises to gRPC status codes.

Streams: the sender cuts each tensor's bytes into chunks of at most
`chunk_bytes`, each naming its tensor, dtype, shape, byte offset and total size,
and the new version. The receiver checks every chunk against the parameters it
serves and only hands over a complete, consistent set: a bad stream changes nothing.

Deltas (`trainer.weights.deltas`): a stream may carry a tensor as the elements that
changed since `base_version` (`encoding: sparse`: their indices, then their new
values), and leave out tensors that did not change; each tensor names the SHA-256
of its whole bytes once applied. The receiver applies them to its own copy of the
base, the bytes it last received with `keep_base` (the engine is not asked for its
weights: a fused or sharded engine holds them in another layout), checks every
checksum and hands the engine a whole version as for a full stream. A receiver
that does not hold the base answers FAILED_PRECONDITION and one whose result does
not match its checksum DATA_LOSS, changing nothing; the trainer then sends the
version whole. Only the bytes that differ travel: with 16-bit weights most
elements of a step's update keep their bytes, with float32 almost none do (the
trainer sends a tensor whole when its delta would not be smaller).

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
from dataclasses import dataclass
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


def wire_bytes(tensor: torch.Tensor) -> bytes:
    """A CPU tensor's bytes as they travel (bfloat16 as its raw 16-bit pattern)."""
    tensor = tensor.detach().contiguous().cpu()
    if tensor.dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {tensor.dtype} cannot be sent; use float32, float16 or bfloat16")
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    return raw.numpy().tobytes()


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of their size, flat: equal bits, equal integers."""
    return tensor.detach().contiguous().cpu().view(_BITS[tensor.element_size()]).reshape(-1)


def sparse_delta(base: torch.Tensor, new: torch.Tensor) -> bytes | None:
    """`new` as the elements whose bytes differ from `base`'s (int32 indices, then the
    new elements); None when that would not be smaller than `new` whole."""
    if base.shape != new.shape or base.dtype != new.dtype:
        return None
    old_bits, new_bits = _bits(base), _bits(new)
    if new_bits.numel() >= 2**31:
        return None
    changed = torch.nonzero(old_bits != new_bits).reshape(-1)
    itemsize = new.element_size()
    if changed.numel() * (4 + itemsize) >= new_bits.numel() * itemsize:
        return None
    return changed.to(torch.int32).numpy().tobytes() + new_bits[changed].numpy().tobytes()


def apply_sparse_delta(base: torch.Tensor, payload: bytes) -> torch.Tensor:
    """`base` with a `sparse_delta` payload applied (a new tensor); WeightStreamError if
    the payload does not fit it."""
    itemsize = base.element_size()
    if len(payload) % (4 + itemsize):
        raise WeightStreamError(f"a sparse delta of {len(payload)} bytes is not whole elements")
    count = len(payload) // (4 + itemsize)
    indices = torch.frombuffer(bytearray(payload[: 4 * count]), dtype=torch.int32).long()
    values = torch.frombuffer(bytearray(payload[4 * count :]), dtype=_BITS[itemsize])
    bits = _bits(base).clone()
    if count and (int(indices.min()) < 0 or int(indices.max()) >= bits.numel()):
        raise WeightStreamError("a sparse delta names elements outside its tensor")
    bits[indices] = values
    return bits.view(base.dtype).reshape(base.shape)


@dataclass
class Encoded:
    """One tensor of an update as it travels."""

    name: str
    dtype: str
    shape: list[int]
    data: bytes
    encoding: str = ""
    """"" (whole), "sparse" (`sparse_delta`) or "lora" (`encode_adapters`)."""
    sha256: bytes = b""
    lora_rank: int = 0
    lora_scaling: float = 0.0
    base_version: int = 0
    """"lora": 0 when `data` begins with the layer's base, else the version it was sent
    with (the receiver must hold it)."""


Adapter = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, float]
"""A LoRA-adapted layer's (weight's wire name, frozen base [out, in], A [r, in],
B [out, r], scale): its weight is base + scale * (B @ A)."""


def merge_adapter(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """base + scaling * (B @ A): the one formula sender and receiver use, so that both
    get the same bits on the same kind of device."""
    return base + (b @ a) * scaling


def encode_adapters(
    adapters: Iterable[Adapter], with_base: bool, base_version: int, checksums: bool = True
) -> list[Encoded]:
    """The adapted layers of one version as "lora" tensors: their adapters, and their
    frozen base too when `with_base` (the receiver does not hold it yet)."""
    import hashlib

    encoded = []
    for name, base, a, b, scaling in adapters:
        parts = ([base] if with_base else []) + [a, b]
        data = b"".join(wire_bytes(t.detach().contiguous().cpu()) for t in parts)
        encoded.append(
            Encoded(
                name,
                DTYPE_NAMES[a.dtype],
                list(base.shape),
                data,
                "lora",
                hashlib.sha256(data).digest() if checksums else b"",
                lora_rank=int(a.shape[0]),
                lora_scaling=float(scaling),
                base_version=0 if with_base else base_version,
            )
        )
    return encoded


def encode_update(
    named: Iterable[tuple[str, torch.Tensor]],
    base: dict[str, torch.Tensor] | None = None,
    checksums: bool = False,
) -> list[Encoded]:
    """The tensors of one version as they travel: whole, or with `base` (the version the
    receivers hold) as sparse deltas where smaller, unchanged tensors left out.
    `checksums`: each carries the SHA-256 of its whole bytes."""
    import hashlib

    encoded = []
    for name, tensor in named:
        tensor = tensor.detach().contiguous().cpu()
        kept = base.get(name) if base is not None else None
        if kept is not None and torch.equal(_bits(kept), _bits(tensor)):
            continue  # unchanged: the receiver keeps its own
        whole = wire_bytes(tensor)
        digest = hashlib.sha256(whole).digest() if checksums else b""
        delta = sparse_delta(kept, tensor) if kept is not None else None
        encoded.append(
            Encoded(
                name,
                DTYPE_NAMES[tensor.dtype],
                list(tensor.shape),
                whole if delta is None else delta,
                "" if delta is None else "sparse",
                digest,
            )
        )
    return encoded


def iter_encoded_chunks(
    encoded: Iterable[Encoded],
    version: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    base_version: int = 0,
    keep_base: bool = False,
) -> Iterator[rollout_pb2.WeightChunk]:
    """Cuts encoded tensors into WeightChunk messages of at most `chunk_bytes` each;
    `base_version`: the version `encode_update`'s base was (0: a whole update)."""
    for tensor in encoded:
        total = len(tensor.data)
        for offset in range(0, max(total, 1), chunk_bytes):
            yield rollout_pb2.WeightChunk(
                version=version,
                name=tensor.name,
                dtype=tensor.dtype,
                shape=tensor.shape,
                offset=offset,
                data=tensor.data[offset : offset + chunk_bytes],
                total_bytes=total,
                base_version=tensor.base_version if tensor.encoding == "lora" else base_version,
                encoding=tensor.encoding,
                sha256=tensor.sha256 if offset == 0 else b"",
                keep_base=keep_base,
                lora_rank=tensor.lora_rank,
                lora_scaling=tensor.lora_scaling,
            )


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
        yield from iter_encoded_chunks(
            [Encoded(name, DTYPE_NAMES[tensor.dtype], list(tensor.shape), wire_bytes(tensor))],
            version,
            chunk_bytes,
        )


def _from_wire(buffer: bytearray, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor over `buffer`'s bytes in `dtype` (bfloat16 read as int16, then viewed)."""
    if dtype == torch.bfloat16:
        return torch.frombuffer(buffer, dtype=torch.int16).view(torch.bfloat16)
    return torch.frombuffer(buffer, dtype=dtype)


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
        self._meta: dict[str, tuple[str, tuple[int, ...], str, int]] = {}
        """name -> (dtype name, shape, encoding, base version)."""
        self._lora: dict[str, tuple[int, float]] = {}
        """"lora" tensors: name -> (rank, scale)."""
        self._digests: dict[str, bytes] = {}
        self.keep_base = False
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
            self.keep_base = chunk.keep_base
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
        if chunk.encoding not in ("", "sparse", "lora") or (
            chunk.encoding == "sparse" and chunk.base_version <= 0
        ):
            raise WeightStreamError(
                f"{chunk.name}: encoding {chunk.encoding!r} with base version "
                f"{chunk.base_version} (a sparse delta names the version it applies to)"
            )
        itemsize = torch.empty(0, dtype=DTYPES[chunk.dtype]).element_size()
        elements = int(torch.Size(shape).numel())
        expected = itemsize * elements
        if chunk.encoding == "lora":
            if len(shape) != 2 or chunk.lora_rank <= 0:
                raise WeightStreamError(
                    f"{chunk.name}: adapters need a 2-d weight and a rank above 0 "
                    f"(shape {shape}, rank {chunk.lora_rank})"
                )
            out, inner = shape
            expected = itemsize * (
                chunk.lora_rank * (inner + out) + (elements if chunk.base_version == 0 else 0)
            )
            if chunk.total_bytes != expected:
                raise WeightStreamError(
                    f"{chunk.name}: total_bytes {chunk.total_bytes} where {expected} are "
                    f"expected for adapters of rank {chunk.lora_rank}"
                )
            self._lora[chunk.name] = (chunk.lora_rank, chunk.lora_scaling)
        elif chunk.encoding == "sparse":
            if chunk.total_bytes % (4 + itemsize) or chunk.total_bytes > (4 + itemsize) * elements:
                raise WeightStreamError(
                    f"{chunk.name}: a sparse delta of {chunk.total_bytes} bytes does not fit "
                    f"{elements} elements of {itemsize} bytes"
                )
            expected = chunk.total_bytes
        elif chunk.total_bytes != expected:
            raise WeightStreamError(
                f"{chunk.name}: total_bytes {chunk.total_bytes} where {expected} are expected"
            )
        buffer = self._buffers.get(chunk.name)
        if buffer is None:
            buffer = self._buffers[chunk.name] = bytearray(expected)
            self._filled[chunk.name] = 0
            self._meta[chunk.name] = (chunk.dtype, shape, chunk.encoding, chunk.base_version)
        elif self._meta[chunk.name] != (chunk.dtype, shape, chunk.encoding, chunk.base_version):
            raise WeightStreamError(f"{chunk.name}: chunks disagree on dtype or encoding")
        if chunk.offset != self._filled[chunk.name] or chunk.offset + len(chunk.data) > expected:
            raise WeightStreamError(
                f"{chunk.name}: chunk at offset {chunk.offset} with {len(chunk.data)} bytes does not follow "
                f"the {self._filled[chunk.name]} bytes received (chunks must arrive in order, without gaps)"
            )
        if chunk.sha256:
            self._digests[chunk.name] = chunk.sha256
        buffer[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
        self._filled[chunk.name] += len(chunk.data)
        self.bytes_received += len(chunk.data)

    def finish(
        self,
        base: dict[str, torch.Tensor] | None = None,
        base_version: int = 0,
        lora_bases: dict[str, torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], int]:
        """The complete tensors as they travelled (their wire dtypes) and the version;
        raises if anything is missing, a delta's base is not `base` at `base_version`
        (the bytes kept from the last `keep_base` stream), or a checksum does not match.
        A delta stream's tensors that did not change come from `base`. "lora" tensors
        are merged on the layer's base from `lora_bases`, where a stream that carries
        a base puts it."""

        if self._version is None:
            raise WeightStreamError("the stream carried no chunks")
        incomplete = sorted(
            name for name, buffer in self._buffers.items() if self._filled[name] != len(buffer)
        )
        if incomplete:
            raise WeightStreamError(f"tensors ended before all their bytes arrived: {incomplete}")
        bases = {meta[3] for meta in self._meta.values() if meta[3] and meta[2] != "lora"}
        if bases and (base is None or bases != {base_version}):
            held = f"holds version {base_version}" if base is not None else "holds no base"
            raise WeightStreamError(
                f"a delta on version {sorted(bases)} where this server {held}: send it whole",
                code="FAILED_PRECONDITION",
            )
        tensors = {}
        for name, buffer in self._buffers.items():
            dtype_name, shape, encoding, sent_base = self._meta[name]
            dtype = DTYPES[dtype_name]
            if encoding == "lora":
                tensors[name] = self._merge(name, buffer, dtype, shape, sent_base, lora_bases)
                continue
            if encoding == "sparse":
                assert base is not None
                kept = base.get(name)
                if kept is None or kept.dtype != dtype or tuple(kept.shape) != shape:
                    raise WeightStreamError(
                        f"{name}: a delta on a tensor this server does not hold as {dtype_name}",
                        code="FAILED_PRECONDITION",
                    )
                tensor = apply_sparse_delta(kept, bytes(buffer))
            else:
                tensor = _from_wire(buffer, dtype)
            tensor = tensor.reshape(shape)
            self._check_digest(name, wire_bytes(tensor))
            tensors[name] = tensor
        if bases:
            assert base is not None
            missing = sorted(set(self._parameters) - set(tensors) - set(base))
            if missing:
                raise WeightStreamError(
                    f"a delta stream left out tensors this server holds no base of: {missing[:5]}",
                    code="FAILED_PRECONDITION",
                )
            for name in self._parameters:
                tensors.setdefault(name, base[name])
        return tensors, self._version

    def _check_digest(self, name: str, data: bytes | bytearray) -> None:
        """DATA_LOSS (counted) when `name` came with a SHA-256 that `data` does not have."""
        import hashlib

        digest = self._digests.get(name)
        if digest and hashlib.sha256(data).digest() != digest:
            COUNTERS.inc("rollout_weight_checksum_mismatches")
            raise WeightStreamError(
                f"{name}: its bytes do not match the checksum sent with them", code="DATA_LOSS"
            )

    def _merge(
        self,
        name: str,
        buffer: bytearray,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        sent_base: int,
        lora_bases: dict[str, torch.Tensor] | None,
    ) -> torch.Tensor:
        """A "lora" tensor's weight: its base (sent now, or held) + scale * (B @ A)."""
        self._check_digest(name, buffer)  # of the bytes as they travelled
        rank, scaling = self._lora[name]
        out, inner = shape
        flat = _from_wire(buffer, dtype)
        if sent_base == 0:
            layer_base = flat[: out * inner].reshape(shape).clone()
            flat = flat[out * inner :]
            if lora_bases is not None:
                lora_bases[name] = layer_base
        else:
            layer_base = (lora_bases or {}).get(name)
            if layer_base is None or layer_base.dtype != dtype or tuple(layer_base.shape) != shape:
                raise WeightStreamError(
                    f"{name}: adapters on a base this server does not hold: send it with them",
                    code="FAILED_PRECONDITION",
                )
        a = flat[: rank * inner].reshape(rank, inner)
        b = flat[rank * inner :].reshape(out, rank)
        return merge_adapter(layer_base, a, b, scaling)


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
        self.kept: dict[str, torch.Tensor] | None = None
        """The last stream's tensors as they travelled, when it asked (`keep_base`)."""
        self.kept_version = 0
        self.lora_bases: dict[str, torch.Tensor] = {}
        """The frozen bases of LoRA-adapted layers, from the first "lora" stream."""

    async def take_stream(
        self, chunks: AsyncIterable[rollout_pb2.WeightChunk]
    ) -> rollout_pb2.UpdateWeightsResponse:
        """Assembles an UpdateWeights stream (whole, or deltas on the bytes kept from the
        last `keep_base` stream) and applies it as one version."""
        started = time.perf_counter()
        specs = self.engine.parameter_specs()
        assembler = WeightAssembler(specs, self.engine.version)
        async for chunk in chunks:
            assembler.add(chunk)
        wire, version = await asyncio.to_thread(
            assembler.finish, self.kept, self.kept_version, self.lora_bases
        )
        tensors = {name: tensor.to(specs[name][1]) for name, tensor in wire.items()}
        apply_seconds = await self.engine.update_weights(tensors, version)
        # The base of the next delta: these bytes as they travelled (freed when not asked).
        self.kept, self.kept_version = (wire, version) if assembler.keep_base else (None, 0)
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
