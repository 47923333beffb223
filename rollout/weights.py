"""Weights on the wire: a state dict as a versioned stream of size-bounded chunks, and back.

The sender (the trainer) walks its parameters and cuts each tensor's bytes into
chunks of at most `chunk_bytes`; every chunk names its tensor, dtype, shape,
byte offset and the tensor's total size, and carries the new version. The
receiver (a rollout-server) checks each chunk against the parameters it serves
and only hands over a complete, consistent set, so a bad stream changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from rollwire.proto.v1 import rollout_pb2

DTYPE_NAMES = {
    torch.float32: "<f4",
    torch.float16: "<f2",
    torch.bfloat16: "bfloat16",
    torch.float64: "<f8",
}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


class WeightStreamError(ValueError):
    """A weight stream that cannot be applied; `code` is the gRPC status name to answer with."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


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
