"""Weights by broadcast: the trainer and every rollout-server in a process group of their own.

The trainer opens a rendezvous store (a torch.distributed `TCPStore`, port picked by
the OS) and asks each rollout-server over gRPC to join as rank 1..n
(`JoinWeightGroup`); it joins as rank 0 itself. The group is a `ProcessGroupNCCL`
between GPUs or a `ProcessGroupGloo` on CPUs, built directly on that store, so it
touches neither process's default process group (the trainer's FSDP group, say).

An update is then one `ReceiveWeights` call per server, naming the tensors in
order and the version, while the trainer broadcasts them from rank 0 in that
order; each server receives into fresh tensors on its device and swaps them in
as it would a gRPC stream. Only tensors move over the group; the control stays
on gRPC, with its deadlines and errors.

A collective cannot lose a member: if any server is gone the broadcast fails
(or times out), so the trainer drops the group for the rest of the run and
sends weights as gRPC streams again, counting `weight_group_failures`; the
servers that missed the version are brought up to date that way.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterable

import torch

from rollwire.rollout.weights import DTYPE_NAMES, DTYPES

log = logging.getLogger(__name__)
BACKENDS = ("gloo", "nccl")


class WeightGroupError(RuntimeError):
    """The group could not form, or a broadcast in it failed."""


def default_backend() -> str:
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
        self.rank, self.world_size, self.backend, self.group_id = (
            rank,
            world_size,
            backend,
            group_id,
        )
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
