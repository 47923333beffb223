"""`rollout_server.weights_from`: a rollout-server fetches the newest version the trainer
keeps (`TrainerService.FetchWeights`, the trainer's `WeightStore`) when it starts.

The chunks are those of an UpdateWeights stream (whole, each tensor's SHA-256 checked,
kept as the base of the next delta) and go through the same `WeightReceiver`, so a push
from the trainer meanwhile is ordered with it by version: whichever is newer stays.
A trainer not up yet, a version superseded between the two calls, or a checksum that
does not match is tried again until `patience` runs out; every outcome is logged.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import grpc.aio

from rollwire.proto.v1 import trainer_pb2, trainer_pb2_grpc
from rollwire.rollout.server.weights import WeightReceiver, WeightStreamError
from rollwire.services.core.client import describe_error, open_channel
from rollwire.services.core.config import ClientConfig
from rollwire.services.core.metrics import COUNTERS

log = logging.getLogger(__name__)

RETRY_PAUSE = 2.0
FETCH_TIMEOUT = 300.0
"""One fetch's deadline: a whole model over the network."""
# Answers worth another try: the trainer is (re)starting, or published a newer version
# between GetVersion and FetchWeights.
_AGAIN = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND,
)


async def fetch_newest(
    receiver: WeightReceiver, address: str, client: ClientConfig, patience: float
) -> bool:
    """Brings `receiver`'s engine to the trainer's newest version; True once it serves that
    version (fetched, or already held), False when `patience` seconds ran out or the
    trainer keeps no store."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    channel = open_channel(address, client)
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
    problem = "no answer"
    try:
        while loop.time() < deadline:
            try:
                version = (
                    await stub.GetVersion(trainer_pb2.VersionRequest(), timeout=5.0)
                ).policy_version
                if version <= receiver.engine.version:
                    log.info(
                        "no weights to fetch",
                        extra={"trainer_version": version, "version": receiver.engine.version},
                    )
                    return True
                call = stub.FetchWeights(
                    trainer_pb2.FetchWeightsRequest(version=version),
                    timeout=min(FETCH_TIMEOUT, max(deadline - loop.time(), 5.0)),
                )
                reply = await receiver.take_stream(call)
                COUNTERS.inc("rollout_weight_fetches")
                log.info(
                    "weights fetched from the trainer",
                    extra={"version": reply.version, "bytes": reply.bytes_received},
                )
                return True
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    log.warning("no weights to fetch: %s", describe_error(error))
                    return False
                if error.code() not in _AGAIN:
                    raise
                problem = describe_error(error)
            except WeightStreamError as error:  # a checksum or a chunk did not match
                COUNTERS.inc("rollout_weight_fetch_failures")
                problem = str(error)
                log.warning("fetched weights refused: %s", error)
            except ValueError:  # the trainer pushed a newer version meanwhile: it stays
                return True
            await asyncio.sleep(min(RETRY_PAUSE, max(deadline - loop.time(), 0.0)))
        COUNTERS.inc("rollout_weight_fetch_failures")
        log.warning(
            "no weights fetched from %s within %g s (%s): serving version %d",
            address,
            patience,
            problem,
            receiver.engine.version,
        )
        return False
    finally:
        await channel.close()
