"""The flow-denoiser family (trainer/models/flow_denoiser.py) under the model-agnostic
Learner: a flow-matching update, a checkpoint diffusers loads (with the scheduler and the
task beside it), an exact restore, and LoRA on the UNet's convolutions."""

from __future__ import annotations

import torch

from rollwire.diffusion.digits import MARKER, DigitsSpec, build_digits_model
from rollwire.services.core.config import TrainerConfig
from rollwire.trainer.learner import Learner
from rollwire.trainer.models.flow_denoiser import FlowDenoiser, Noised


def flow_matching_update(learner: Learner, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    x0 = torch.rand(16, 1, 8, 8, generator=generator) * 2 - 1
    noise = torch.randn(16, 1, 8, 8, generator=generator)
    t = torch.rand(16, generator=generator)
    xt = (1 - t).view(-1, 1, 1, 1) * x0 + t.view(-1, 1, 1, 1) * noise
    labels = torch.randint(0, 11, (16,), generator=generator)
    loss = torch.nn.functional.mse_loss(learner.forward(Noised(xt, t, labels)), noise - x0)
    learner.backend.backward(loss)
    learner.optimizer_update()
    return loss.item()


def test_a_denoiser_trains_saves_a_diffusers_folder_and_resumes_exactly(tmp_path) -> None:
    from diffusers import UNet2DModel

    start = build_digits_model(
        tmp_path / "start", DigitsSpec(steps=2, batch_size=8), progress=False
    )
    config = TrainerConfig(optimizer={"learning_rate": 1e-3})
    learner = Learner(start, config, family=FlowDenoiser(), total_updates=4)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    flow_matching_update(learner, 0)
    assert any(not torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    folder = learner.save_checkpoint(tmp_path / "checkpoint", step=1, version=1)
    assert (folder / "scheduler" / "scheduler_config.json").exists() and (folder / MARKER).exists()
    loaded = UNet2DModel.from_pretrained(folder)
    for name, p in learner.model.named_parameters():
        assert torch.equal(loaded.state_dict()[name], p.detach()), name
    # Resumed: the same weights, optimizer and schedule, so the next update is the same.
    resumed = Learner(start, config, family=FlowDenoiser(), total_updates=4)
    assert resumed.restore(folder)["step"] == 1 and resumed.optimizer_steps == 1
    assert flow_matching_update(learner, 1) == flow_matching_update(resumed, 1)
    for (name, a), (_, b) in zip(learner.named_weights(), resumed.named_weights(), strict=True):
        assert torch.equal(a, b), name


def test_lora_on_the_unet_trains_adapters_only_and_publishes_merged_weights(tmp_path) -> None:
    start = build_digits_model(
        tmp_path / "start", DigitsSpec(steps=2, batch_size=8), progress=False
    )
    config = TrainerConfig(
        optimizer={"learning_rate": 1e-2}, lora={"rank": 4, "target_modules": ["conv1", "conv2"]}
    )
    learner = Learner(start, config, family=FlowDenoiser(), total_updates=4)
    trainable = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    plain = dict(FlowDenoiser().load(start).named_parameters())
    flow_matching_update(learner, 0)
    published = dict(learner.named_weights())
    assert set(published) == set(plain)  # the UNet's own names: what an engine loads
    changed = [n for n in plain if not torch.equal(published[n], plain[n].detach())]
    assert changed and all(n.endswith(("conv1.weight", "conv2.weight")) for n in changed)
