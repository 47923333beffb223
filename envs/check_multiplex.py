"""The Multiplex part of `rollwire env-check` (see `rollwire.envs.check`).

Batched Reset/Step/Close calls on one stream: each must be answered exactly
once by its call_id, failures in-band as CallError, the sessions shared with
the unary calls, and the stream must end cleanly after a half-close.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
import grpc.aio

from rollwire.envs.check_probe import (
    UNKNOWN_ENV_ID,
    CheckFailed,
    CheckSkipped,
    Probe,
    Reply,
    code_name,
)
from rollwire.proto.v1 import env_pb2
from rollwire.services.core.client import describe_error


class MultiplexCheck:
    """Batched calls on one stream: each answered once by call_id, errors in-band, stream lives on."""

    def __init__(self, suite: Probe) -> None:
        self.suite = suite
        self.call: Any = None
        self.answered: set[int] = set()

    async def _exchange(self, calls: list[env_pb2.EnvCall]) -> dict[int, env_pb2.EnvReply]:
        """Sends one batch and reads until every call in it is answered."""
        await asyncio.wait_for(
            self.call.write(env_pb2.EnvCallBatch(calls=calls)), self.suite.timeout
        )
        pending = {call.call_id for call in calls}
        replies: dict[int, env_pb2.EnvReply] = {}
        while pending:
            batch = await asyncio.wait_for(self.call.read(), self.suite.timeout)
            if batch is grpc.aio.EOF:
                raise CheckFailed(f"the stream ended with calls {sorted(pending)} unanswered")
            for reply in batch.replies:
                if reply.call_id in self.answered:
                    raise CheckFailed(f"call_id {reply.call_id} was answered twice")
                if reply.call_id not in pending:
                    raise CheckFailed(f"a reply for call_id {reply.call_id}, which was never sent")
                self.answered.add(reply.call_id)
                pending.discard(reply.call_id)
                replies[reply.call_id] = reply
        return replies

    @staticmethod
    def _expect(
        reply: env_pb2.EnvReply, kind: str, what: str, code: grpc.StatusCode | None = None
    ) -> None:
        got = reply.WhichOneof("reply")
        if got != kind:
            detail = (
                f" {code_name(reply.error.code)}: {reply.error.message}" if got == "error" else ""
            )
            raise CheckFailed(f"{what}: expected a {kind} reply, got {got}{detail}")
        if code is not None and reply.error.code != code.value[0]:
            raise CheckFailed(
                f"{what}: expected error {code.name}, got {code_name(reply.error.code)}: "
                f"{reply.error.message}"
            )

    async def _unary_step(self, session_id: str, action: str) -> str:
        """Steps a session opened through Multiplex with unary Step: it must be known there."""
        try:
            await self.suite.raw_step(session_id, action)
        except grpc.aio.AioRpcError as error:
            allowed = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
            if error.code() in allowed:
                return error.code().name
            raise CheckFailed(
                f"unary Step on a session opened through Multiplex: {describe_error(error)}"
            ) from None
        return "OK"

    async def run(self) -> str:
        suite = self.suite
        suite.need_env()
        not_found = grpc.StatusCode.NOT_FOUND
        unary_id, _ = await suite.reset(seed=1)
        mux_id = ""
        self.call = suite.stub.Multiplex(timeout=suite.timeout * 6, metadata=suite.stream_metadata)
        try:
            first = await self._exchange(
                [
                    env_pb2.EnvCall(call_id=1, reset=suite.reset_request(0)),
                    env_pb2.EnvCall(
                        call_id=2, reset=env_pb2.ResetRequest(env_id=UNKNOWN_ENV_ID, seed=0)
                    ),
                    env_pb2.EnvCall(
                        call_id=3, step=env_pb2.StepRequest(session_id=uuid.uuid4().hex)
                    ),
                    env_pb2.EnvCall(
                        call_id=4, close=env_pb2.CloseRequest(session_id=uuid.uuid4().hex)
                    ),
                    env_pb2.EnvCall(call_id=2**64 - 1),  # carries no call: must still be answered
                ]
            )
            self._expect(first[1], "reset", "Reset in a batch")
            mux_id = first[1].reset.session_id
            self._expect(first[2], "error", "Reset of an unknown env in a batch", not_found)
            self._expect(first[3], "error", "Step on an unknown session in a batch", not_found)
            self._expect(first[4], "close", "Close of an unknown session in a batch")
            if first[4].close.existed:
                raise CheckFailed("Close of an unknown session in a batch answered existed=true")
            self._expect(first[2**64 - 1], "error", "an EnvCall carrying no call")
            action = suite.options.actions[0]
            second = await self._exchange(
                [
                    env_pb2.EnvCall(
                        call_id=10, step=env_pb2.StepRequest(session_id=mux_id, action=action)
                    ),
                    env_pb2.EnvCall(
                        call_id=11, step=env_pb2.StepRequest(session_id=unary_id, action=action)
                    ),
                ]
            )
            for call_id, what in ((10, "a Multiplex session"), (11, "a unary session")):
                reply = second[call_id]
                if reply.WhichOneof("reply") == "error":
                    if reply.error.code != grpc.StatusCode.INVALID_ARGUMENT.value[0]:
                        raise CheckFailed(
                            f"Step on {what} in a batch: {code_name(reply.error.code)}: "
                            f"{reply.error.message}"
                        )
                else:
                    self._expect(reply, "step", f"Step on {what} in a batch")
            reference = suite.transcripts.get(0)
            if reference is not None and len(reference) > 1:
                step = second[10]
                is_error = step.WhichOneof("reply") == "error"
                got = Reply("INVALID_ARGUMENT") if is_error else Reply.from_step(step.step)
                if got != reference[1]:
                    raise CheckFailed(
                        f"seed 0 through Multiplex: {got.brief()} vs unary {reference[1].brief()}"
                    )
            unary_step = await self._unary_step(mux_id, action)
            third = await self._exchange(
                [
                    env_pb2.EnvCall(call_id=20, close=env_pb2.CloseRequest(session_id=mux_id)),
                    env_pb2.EnvCall(call_id=21, close=env_pb2.CloseRequest(session_id=unary_id)),
                ]
            )
            for call_id in (20, 21):
                self._expect(third[call_id], "close", "Close in a batch")
                if not third[call_id].close.existed:
                    raise CheckFailed("Close in a batch of an open session answered existed=false")
            mux_id = unary_id = ""
            await asyncio.wait_for(self.call.done_writing(), suite.timeout)
            tail = await asyncio.wait_for(self.call.read(), suite.timeout)
            if tail is not grpc.aio.EOF:
                raise CheckFailed("the server sent replies after every call was answered")
            code = await asyncio.wait_for(self.call.code(), suite.timeout)
            if code is not grpc.StatusCode.OK:
                raise CheckFailed(f"the stream ended with {code.name} after a clean half-close")
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.UNIMPLEMENTED:
                raise CheckSkipped(
                    "Multiplex is UNIMPLEMENTED (optional; clients fall back to unary)"
                ) from None
            raise CheckFailed(f"the Multiplex stream failed: {describe_error(error)}") from None
        except TimeoutError:
            raise CheckFailed(f"no Multiplex answer within {suite.timeout:g}s") from None
        finally:
            self.call.cancel()
            for session_id in (mux_id, unary_id):
                if session_id:
                    await suite.close(session_id)
        return (
            f"{len(self.answered)} calls answered once by call_id; errors in-band; sessions shared "
            f"with unary calls (unary Step on a batch session: {unary_step})"
        )
