"""The trainer's weight store (`trainer.weights.store`): the newest published version,
whole, for any rollout-server to fetch by version (`TrainerService.FetchWeights`).

Pushing each version to the rollout-servers the trainer knows stays the fast path
(`weight_sender.publish`). The store is for a server the trainer does not know yet, or
one that came back: it asks for the newest version (`rollout_server.weights_from`) and
gets it whole, every tensor with its SHA-256, checked as it is applied, and kept as the
base of the next delta. Only the newest version is kept: a newcomer never replays a
chain of deltas, and the trainer holds one copy of the weights on its CPU (the version's
tensors; their encoding too while fetches of that version are being answered).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator

import torch

from rollwire.proto.v1 import rollout_pb2
from rollwire.rollout.server.weights import Encoded, encode_update, iter_encoded_chunks
from rollwire.services.core.metrics import COUNTERS

log = logging.getLogger(__name__)


class VersionGone(LookupError):
    """The store holds another version than the one asked for."""


class WeightStore:
    """The newest published version (`put`), encoded once when first fetched (`chunks`)."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.version: int | None = None
        self._named: list[tuple[str, torch.Tensor]] = []
        self._encoded: tuple[int, list[Encoded]] | None = None
        self._lock = asyncio.Lock()

    def put(self, named: Iterable[tuple[str, torch.Tensor]], version: int, copy: bool) -> None:
        """Keeps `named` as `version` (a CPU copy unless `copy` is False: tensors nothing
        changes any more, such as a publish's snapshot). Runs in a worker thread."""
        kept = [
            (name, t.detach().to("cpu", copy=True) if copy else t.detach()) for name, t in named
        ]
        self._named, self.version, self._encoded = kept, version, None

    async def chunks(self, version: int = 0) -> tuple[int, Iterator[rollout_pb2.WeightChunk]]:
        """(the version, its chunks) for `version` (0: the newest). LookupError when the
        store holds nothing yet, VersionGone when it holds another version."""
        async with self._lock:
            if self.version is None:
                raise LookupError("no version is published yet")
            if version and version != self.version:
                raise VersionGone(
                    f"the trainer keeps its newest version only ({self.version}), not {version}"
                )
            if self._encoded is None or self._encoded[0] != self.version:
                held, named = self.version, self._named
                encoded = await asyncio.to_thread(encode_update, named, None, True)
                self._encoded = (held, encoded)
            held, encoded = self._encoded
        COUNTERS.inc("trainer_weight_fetches")
        log.info("weights fetched", extra={"version": held, "tensors": len(encoded)})
        return held, iter_encoded_chunks(encoded, held, self.chunk_bytes, 0, keep_base=True)
