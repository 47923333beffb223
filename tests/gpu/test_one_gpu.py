"""What one CUDA GPU can check: the trainer step in bf16 against float32, the HF engine's
logprobs against the trainer's forward on the device (a causal LM, and a vision-language
model with images), and weights sent from a trainer process to a rollout-server process
on the same device.

`deploy/gpu/checks.sh` runs these on the lent GPU machine. `ROLLWIRE_TEST_DEVICE=cpu`
runs them here, on the CPU, which checks the checks themselves (the conftest then lets
this file's `gpu` tests run); the bars are the GPU's, measured where it is said.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
from rollwire.rollout.server.hf_engine import HFEngine
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import RLSection, TrainerConfig
from rollwire.trainer.pipelines.common import save_model
from rollwire.trainer.process.weight_sender import publish
from rollwire.trainer.rl.mismatch import measure
from rollwire.trainer.rl.policy import Policy
from tests.conftest import rollout_server_args
from tests.helpers.servers import serve_engine
from tests.helpers.trajectories import group

DEVICE = os.environ.get("ROLLWIRE_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return {
        name: tensor.float() for name, tensor in load_file(folder / "model.safetensors").items()
    }


def _step(model_path: Path, precision: str) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One RL step on two fixed groups on DEVICE; its metrics and the weights after it."""
    torch.manual_seed(0)
    config = TrainerConfig(
        device=DEVICE, precision=precision, learning_rate=1e-3, micro_batch_size=4
    )
    policy = Policy(model_path, config, RLSection(group_size=4, max_steps=4))
    try:
        metrics = policy.train_step(group([1.0, 0.0, 1.0, 0.0]) + group([0.0, 1.0, 0.0, 0.0]), 0)
        weights = {name: tensor.float().cpu() for name, tensor in policy.named_weights()}
    finally:
        policy.close()
    return metrics, weights


def test_the_trainer_step_in_bf16_follows_float32_on_the_same_batch(tiny_model_path) -> None:
    """bf16 autocast on float32 master weights moves the weights as float32 does: the same
    loss and gradient norm within bf16's precision, updates pointing the same way."""
    start = _weights(tiny_model_path)
    fp32, fp32_weights = _step(tiny_model_path, "fp32")
    bf16, bf16_weights = _step(tiny_model_path, "bf16")
    update32 = torch.cat([(fp32_weights[n] - start[n]).flatten() for n in sorted(start)])
    update16 = torch.cat([(bf16_weights[n] - start[n]).flatten() for n in sorted(start)])
    cosine = float(torch.nn.functional.cosine_similarity(update32, update16, dim=0))
    print(
        f"{DEVICE}: loss fp32 {fp32['loss']:.5f} bf16 {bf16['loss']:.5f}; grad norm fp32 "
        f"{fp32['grad_norm']:.4f} bf16 {bf16['grad_norm']:.4f}; update cosine {cosine:.4f}"
    )
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.02, abs=1e-3)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=0.05)
    assert cosine > 0.95


@pytest.mark.parametrize(
    ("dtype", "precision", "abs_max", "kl"),
    [("float32", "fp32", 1e-4, 1e-8), ("bfloat16", "bf16", 0.25, 1e-3)],
    ids=["fp32", "bf16"],
)
async def test_the_hf_engine_on_the_device_agrees_with_the_trainers_forward(
    start_service, tiny_model_path, dtype: str, precision: str, abs_max: float, kl: float
) -> None:
    """`rollwire mismatch` between the engine on DEVICE and the trainer's forward there. bf16
    weights (the engine) against bf16 autocast on float32 weights (the trainer) differ by
    rounding: the bar is bf16's, float32's is 1e-4."""
    engine = HFEngine(tiny_model_path, max_batch_size=16, dtype=dtype, device=DEVICE)
    address, _ = await serve_engine(start_service, engine)
    report = await measure(
        address, requests=16, max_new_tokens=24, device=DEVICE, precision=precision
    )
    print(f"{DEVICE} {dtype} engine against the trainer's {precision} forward:\n{report.table()}")
    assert report.tokens == 16 * 24
    assert report.abs_max < abs_max and report.kl < kl, report.table()


async def test_the_hf_engine_with_images_on_the_device_agrees_with_the_trainers_forward(
    tiny_vlm_path,
) -> None:
    """The tiny vision-language model on DEVICE: the engine's logprobs of what it sampled
    for digit pictures (pixels, three-dimensional positions, placeholders suppressed) and
    the trainer's `VisionLM` forward there agree to float32's bar on the GPU."""
    from rollwire.rollout.server.sampling import SamplingSpec
    from tests.helpers.vision import digit_prompts, trainer_gap

    prompts = digit_prompts(tiny_vlm_path, 8)
    engine = HFEngine(tiny_vlm_path, max_batch_size=8, device=DEVICE)
    await engine.start()
    try:
        outputs = await asyncio.gather(
            *(
                engine.generate(f"r{i}", ids, SamplingSpec(max_new_tokens=12, seed=i), images)
                for i, (ids, images) in enumerate(prompts)
            )
        )
    finally:
        await engine.close()
    gap, compared = trainer_gap(tiny_vlm_path, prompts, outputs, DEVICE)
    print(f"{DEVICE}: images in the engine against the trainer's forward: max gap {gap:.2e}")
    assert compared > 60 and gap <= 1e-4, gap


async def test_weights_from_a_trainer_reach_a_rollout_server_process_on_the_same_device(
    spawn, tmp_path, tiny_model_path
) -> None:
    """A trainer (this process) publishes two versions to a rollout-server process, both on
    DEVICE, as gRPC chunk streams (what one device has: NCCL wants a device per member); the
    server's logprobs then are those of the trainer's new weights."""
    ready = tmp_path / "ready"
    server = spawn(
        [*rollout_server_args(tiny_model_path, ready), "--set", f"rollout_server.device={DEVICE}"]
    )
    address = server.wait_for_file(ready, timeout=120)
    config = TrainerConfig(device=DEVICE, learning_rate=1e-2, micro_batch_size=4)
    policy = Policy(tiny_model_path, config, RLSection(group_size=4, max_steps=4))
    try:
        async with open_channel(address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            for version in (1, 2):
                policy.train_step(group([1.0, 0.0, 1.0, 0.0], version - 1), version - 1)
                seconds = await publish([stub], policy, version, chunk_bytes=1 << 20)
                status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest(), timeout=10)
                assert status.policy_version == version
                print(f"version {version} sent in {seconds:.3f}s")
            saved = save_model(policy, tmp_path / "trained", 2)
        report = await measure(address, saved, requests=8, max_new_tokens=12, device=DEVICE)
    finally:
        await asyncio.to_thread(policy.close)
    print(report.table())
    assert report.policy_version == 2 and report.abs_max < 1e-4, report.table()
    code, _, err = server.terminate()
    assert code == 0, err


def test_this_module_runs_where_it_says(tiny_model_path) -> None:
    """The checks above ran on DEVICE, not silently on the CPU."""
    engine = HFEngine(tiny_model_path, device=DEVICE)
    assert next(engine.model.parameters()).device.type == torch.device(DEVICE).type
    print(
        f"device {DEVICE}: {torch.cuda.get_device_name() if DEVICE.startswith('cuda') else sys.platform}"
    )
