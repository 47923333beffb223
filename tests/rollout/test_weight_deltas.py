"""Weights sent as deltas (`trainer.weights.deltas`): the bytes that changed, checked by
checksum, equal to the same versions sent whole; refused deltas are sent whole. A LoRA
run's adapters alone (`trainer.weights.adapters`), merged by the server, the same."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest
import torch

from rollwire.proto.v1 import rollout_pb2_grpc
from rollwire.rollout.server.weights import (
    apply_sparse_delta,
    encode_adapters,
    encode_update,
    iter_encoded_chunks,
    sparse_delta,
)
from rollwire.services.core.client import open_channel
from rollwire.services.core.metrics import COUNTERS
from rollwire.trainer.process.weight_sender import Adapters, Deltas, publish
from tests.rollout.test_weight_group import start_servers

torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_sparse_delta_rebuilds_the_new_tensor_bit_for_bit(dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(64, 33, generator=generator).to(dtype)
    new = base.clone()
    new.view(-1)[torch.randperm(new.numel(), generator=generator)[:40]] += 1
    new.view(-1)[7] = float("nan")  # a NaN's bits travel like any other value's
    payload = sparse_delta(base, new)
    assert payload is not None and len(payload) == 41 * (4 + new.element_size())
    rebuilt = apply_sparse_delta(base, payload)
    assert rebuilt.dtype == dtype and torch.equal(rebuilt.view(torch.uint8), new.view(torch.uint8))
    assert sparse_delta(base, base + 1) is None  # every element changed: whole is smaller


class Policy:
    """What `publish` reads of the trainer's policy: bf16 weights that move a little each
    version, as a step's update moves weights kept in 16 bits."""

    def __init__(self, model) -> None:
        self.master = {n: p.detach().clone().float() for n, p in model.named_parameters()}
        self.generator = torch.Generator().manual_seed(1)

    def step(self) -> None:
        for tensor in self.master.values():
            tensor += 1e-5 * torch.randn(tensor.shape, generator=self.generator)

    def named_weights(self):
        return [(name, t.to(torch.bfloat16)) for name, t in self.master.items()]


def assert_serves(engine, policy: Policy, version: int) -> None:
    assert engine.version == version
    wanted = dict(policy.named_weights())
    for name, parameter in engine.model.named_parameters():
        assert torch.equal(parameter.detach(), wanted[name].to(parameter.dtype)), name


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_versions_sent_as_deltas_equal_the_same_versions_sent_whole(
    start_service, tiny_model_path
) -> None:
    servers = await start_servers(start_service, tiny_model_path, 2)
    channels = [open_channel(runtime.address) for _, _, runtime in servers]
    by_delta, whole = (rollout_pb2_grpc.RolloutServiceStub(c) for c in channels)
    policy, deltas = Policy(servers[0][0].model), Deltas()
    try:
        ratios = []
        for version in range(1, 6):
            policy.step()
            await publish([by_delta], policy, version, 1 << 16, deltas=deltas)
            await publish([whole], policy, version, 1 << 16)
            for engine, _, _ in servers:
                assert_serves(engine, policy, version)
            ratios.append(deltas.bytes_sent / deltas.bytes_whole)
        assert ratios[0] == pytest.approx(1.0, abs=0.01)  # the first version goes whole
        assert max(ratios[1:]) < 0.9, ratios  # then only what changed in 16 bits

        # The server lost its base (it restarted, say): the delta is refused, counted, and
        # the version sent whole.
        servers[0][1].weights.kept = None
        refused = COUNTERS.get("trainer_deltas_refused")
        policy.step()
        await publish([by_delta], policy, 6, 1 << 16, deltas=deltas)
        assert COUNTERS.get("trainer_deltas_refused") == refused + 1
        assert_serves(servers[0][0], policy, 6)
        assert deltas.bytes_sent > deltas.bytes_whole  # the refused delta, then the whole

        # Bytes that do not match their checksum are refused and change nothing.
        policy.step()
        encoded = encode_update(policy.named_weights(), deltas.base, checksums=True)
        encoded[0].sha256 = bytes(32)
        with pytest.raises(grpc.aio.AioRpcError) as refusal:
            await by_delta.UpdateWeights(
                iter_encoded_chunks(encoded, 7, 1 << 16, deltas.base_version, keep_base=True),
                timeout=30,
            )
        assert refusal.value.code() == grpc.StatusCode.DATA_LOSS
        assert servers[0][0].version == 6
        await publish([by_delta], policy, 7, 1 << 16, deltas=deltas)
        assert_serves(servers[0][0], policy, 7)
    finally:
        for channel in channels:
            await channel.close()
        for _, servicer, _ in servers:
            await servicer.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_lora_runs_adapters_alone_equal_its_merged_weights_sent_whole(
    start_service, tiny_model_path
) -> None:
    """`trainer.weights.adapters`: four versions of a LoRA run sent as adapters to one
    server and whole to another leave both serving the trainer's merged weights bit for
    bit; a server that lost the bases refuses, is counted and gets them again."""
    from tests.helpers.trajectories import group
    from tests.trainer.test_lora import make_policy

    servers = await start_servers(start_service, tiny_model_path, 2)
    channels = [open_channel(runtime.address) for _, _, runtime in servers]
    by_adapters, whole = (rollout_pb2_grpc.RolloutServiceStub(c) for c in channels)
    policy, adapters = make_policy(tiny_model_path, learning_rate=5e-2), Adapters()

    def assert_both_serve(version: int) -> None:
        wanted = dict(policy.named_weights())
        for engine, _, _ in servers:
            assert engine.version == version
            for name, parameter in engine.model.named_parameters():
                assert torch.equal(parameter.detach(), wanted[name]), name

    try:
        ratios = []
        for version in range(1, 5):
            policy.train_step(group(), version - 1)
            await publish([by_adapters], policy, version, 1 << 16, adapters=adapters)
            await publish([whole], policy, version, 1 << 16)
            assert_both_serve(version)
            ratios.append(adapters.bytes_sent / adapters.bytes_whole)
        # The first carries the adapted layers' bases; then the adapters alone.
        assert ratios[1] < ratios[0] < 1 and max(ratios[1:]) < 0.15, ratios
        print(f"adapters / whole bytes by version: {ratios}")

        servers[0][1].weights.lora_bases.clear()  # restarted, say
        refused = COUNTERS.get("trainer_adapters_refused")
        policy.train_step(group(), 4)
        await publish([by_adapters], policy, 5, 1 << 16, adapters=adapters)
        await publish([whole], policy, 5, 1 << 16)
        assert COUNTERS.get("trainer_adapters_refused") == refused + 1
        assert_both_serve(5)
        # What went over the wire: the refused adapters, then the adapters with the bases.
        assert adapters.bytes_sent / adapters.bytes_whole == pytest.approx(ratios[0] + ratios[1])

        # Adapters whose bytes do not match their checksum are refused.
        encoded = encode_adapters(policy.named_adapters(), False, adapters.base_version)
        encoded[0].sha256 = bytes(32)
        with pytest.raises(grpc.aio.AioRpcError) as refusal:
            await by_adapters.UpdateWeights(iter_encoded_chunks(encoded, 6, 1 << 16), timeout=30)
        assert refusal.value.code() == grpc.StatusCode.DATA_LOSS
        assert servers[0][0].version == 5
    finally:
        for channel in channels:
            await channel.close()
        for _, servicer, _ in servers:
            await servicer.close()
