"""`rollout_server.weights_from`: a rollout-server fetches the newest version the trainer
keeps (`TrainerService.FetchWeights`, the trainer's `WeightStore`) when it starts.

The chunks are those of an UpdateWeights stream (whole, each tensor's SHA-256 checked,
kept as the base of the next delta) and go through the same `WeightReceiver`, so a push
from the trainer meanwhile is ordered with it by version: whichever is newer stays.
A trainer not up yet, a version superseded between the two calls, or a checksum that
does not match is tried again until `patience` runs out; every outcome is logged. A
trainer that does not answer at all (a run starting, or the trainer restarting too)
leaves the server serving what it has meanwhile, unless it awaits weights: the trainer
then pushes it the current version as soon as it is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

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
    receiver: WeightReceiver,
    address: str,
    client: ClientConfig,
    patience: float,
    unreachable: Callable[[], None] | None = None,
) -> bool:
    """Brings `receiver`'s engine to the trainer's newest version; True once it serves that
    version (fetched, or already held), False when `patience` seconds ran out or the
    trainer keeps no store. `unreachable` is called once if the trainer does not answer
    the first try (a run starting, or a trainer restarting): the tries go on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    problem = "no answer"
    answered = False
    while loop.time() < deadline:
        # A channel per try: a name that did not resolve yet is looked up again.
        channel = open_channel(address, client)
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        try:
            version = (
                await stub.GetVersion(trainer_pb2.VersionRequest(), timeout=5.0)
            ).policy_version
            answered = True
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
            if not answered and unreachable is not None:
                log.info(
                    "the trainer at %s does not answer yet (%s): serving version %d meanwhile, "
                    "and trying again",
                    address,
                    problem,
                    receiver.engine.version,
                )
                unreachable()
                unreachable = None
        except WeightStreamError as error:  # a checksum or a chunk did not match
            COUNTERS.inc("rollout_weight_fetch_failures")
            problem = str(error)
            log.warning("fetched weights refused: %s", error)
        except ValueError:  # the trainer pushed a newer version meanwhile: it stays
            return True
        finally:
            await channel.close()
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
