"""On-policy distillation's teacher, as the orchestrator calls it.

With `trainer.algorithm.advantage: on_policy_distill` every group the student samples is sent to
a teacher rollout-server (`endpoints.teacher_servers`, round-robin) before it goes to
the buffer: one `ScoreTokens` call per group returns the teacher's logprob of each
generated token, which travels in the trajectory (`teacher_logprobs`) to the trainer.
Before the first group the teacher's tokenizer is checked against the student's: the
teacher's logprobs of the student's token ids mean nothing under another vocabulary.
"""

from __future__ import annotations

import itertools
import uuid

import numpy as np

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
from rollwire.rollout.orchestrator.servers import call_server, server_retries
from rollwire.services.core.client import open_channel, wait_for_serving
from rollwire.services.core.config import RunConfig
from rollwire.services.core.images import to_proto
from rollwire.services.core.wire import Trajectory


class TokenizerMismatch(ValueError):
    """The teacher's tokenizer is not the student's."""


class Teacher:
    """ScoreTokens calls to the teacher rollout-servers (see the module docstring)."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.settings = config.orchestrator
        self.addresses = list(config.endpoints.teacher_servers)
        if not self.addresses:
            raise ValueError(
                "trainer.algorithm.advantage on_policy_distill: endpoints.teacher_servers is empty "
                "(rollwire train fills it from distill.teacher_model_path)"
            )
        self.channels = [open_channel(a, config.client) for a in self.addresses]
        self.stubs = [rollout_pb2_grpc.RolloutServiceStub(c) for c in self.channels]
        self._next = itertools.cycle(range(len(self.stubs)))
        self.retries = server_retries(config)
        self.scored_tokens = 0

    async def connect(self, student: list[rollout_pb2_grpc.RolloutServiceStub]) -> None:
        """Waits for every teacher server; raises TokenizerMismatch unless each has the
        tokenizer of the student's rollout-servers."""
        timeout = self.config.client.connect_timeout_seconds
        for address, channel in zip(self.addresses, self.channels, strict=True):
            await wait_for_serving(channel, timeout=timeout, target=address)
        request = rollout_pb2.RolloutStatusRequest()
        students = [await stub.GetStatus(request, timeout=timeout) for stub in student]
        teachers = [await stub.GetStatus(request, timeout=timeout) for stub in self.stubs]
        expected = students[0].tokenizer_digest
        for status, address in zip(teachers, self.addresses, strict=True):
            if not expected or status.tokenizer_digest != expected:
                raise TokenizerMismatch(
                    f"the teacher at {address} ({status.model}) does not share the student's "
                    f"tokenizer ({students[0].model}): on-policy distillation scores the "
                    "student's token ids under the teacher, so both need one vocabulary "
                    f"(tokenizer digests {status.tokenizer_digest[:12] or 'unknown'} and "
                    f"{expected[:12] or 'unknown'})"
                )

    async def score(self, trajectories: list[Trajectory]) -> None:
        """Sets every trajectory's `teacher_logprobs`: the teacher's logprob of each
        generated token, 0 elsewhere; one call for the group."""
        rows, sequences = [], []
        for index, trajectory in enumerate(trajectories):
            trajectory.teacher_logprobs = np.zeros(trajectory.num_tokens, np.float32)
            generated = np.flatnonzero(trajectory.loss_mask)
            if generated.size:
                rows.append((index, int(generated[0])))
                sequences.append(
                    rollout_pb2.TokenSequence(
                        token_ids=trajectory.token_ids.tolist(),
                        start=int(generated[0]),
                        images=[to_proto(i) for i in trajectory.images],
                    )
                )
        if not sequences:
            return
        request = rollout_pb2.ScoreTokensRequest(request_id=uuid.uuid4().hex, sequences=sequences)
        stub = self.stubs[next(self._next)]
        reply = await call_server(
            lambda: stub.ScoreTokens(request, timeout=self.settings.generate_timeout_seconds),
            self.retries,
            "teacher",
        )
        for (index, start), scores in zip(rows, reply.sequences, strict=True):
            trajectory = trajectories[index]
            values = np.asarray(scores.logprobs, np.float32)
            teacher = trajectory.teacher_logprobs
            teacher[start : start + values.shape[0]] = values
            # Observations and tool output between turns were scored too: not the student's.
            teacher *= trajectory.loss_mask.astype(np.float32)
            self.scored_tokens += int(trajectory.loss_mask.sum())

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
