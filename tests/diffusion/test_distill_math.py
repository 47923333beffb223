"""The distillation math by hand: the clean prediction, the ODE-distillation and flow
matching losses, DMD's direction and loss (and, with exact scores on a Gaussian, that
following it moves a generator onto the teacher's distribution), the GAN terms, the
few-step sampler and the EMA."""

from __future__ import annotations

import math

import pytest
import torch

from rollwire.diffusion.distill import (
    UNetFeatures,
    clean_of,
    dmd_direction,
    dmd_generator_loss,
    ema_update,
    feature_distance,
    few_step_sample,
    flow_matching_loss,
    gan_generator_loss,
    gan_head_loss,
    noised,
    ode_distill_loss,
    student_times,
)


def point_mass(at: float):
    """The exact velocity field of data that is always `at`: v = (x_t - at) / t."""

    def velocity(x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (x - at) / t.reshape(-1, *([1] * (x.dim() - 1)))

    return velocity


def gaussian_clean(mean: float, std: float):
    """E[x0 | x_t] for data N(mean, std^2) in one dimension, x_t = (1 - t) x0 + t eps."""

    def clean(x: torch.Tensor, t: float) -> torch.Tensor:
        gain = (1 - t) * std**2 / ((1 - t) ** 2 * std**2 + t**2)
        return mean + gain * (x - (1 - t) * mean)

    return clean


def test_the_clean_prediction_undoes_the_noising() -> None:
    x0, noise = torch.randn(4, 1, 2, 2), torch.randn(4, 1, 2, 2)
    t = torch.tensor([0.1, 0.4, 0.7, 1.0])
    x_t = noised(x0, noise, t)
    assert torch.allclose(x_t[1], 0.6 * x0[1] + 0.4 * noise[1])
    assert torch.allclose(clean_of(x_t, noise - x0, t), x0, atol=1e-6)


def test_ode_distillation_and_flow_matching_losses_by_hand() -> None:
    x_t = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
    t = torch.tensor([0.5, 0.25])
    teacher = torch.tensor([[0.0, 1.0], [1.0, 1.0]])

    def constant(x, t, labels):
        return torch.full_like(x, 2.0)

    # Predictions x_t - t * 2: [[0, 2], [1.5, -0.5]]; squared errors [[0, 1], [0.25, 2.25]].
    loss = ode_distill_loss(constant, x_t, t, torch.zeros(2), teacher)
    assert loss.tolist() == pytest.approx([0.5, 1.25])
    # The exact field of a point mass has no flow-matching loss; a shifted one pays its shift.
    x0, noise = torch.full((3, 1, 2, 2), 0.7), torch.randn(3, 1, 2, 2)
    times = torch.tensor([0.2, 0.5, 0.9])
    assert flow_matching_loss(point_mass(0.7), x0, noise, times, None).abs().max() < 1e-5
    off = flow_matching_loss(lambda x, t, y: point_mass(0.7)(x, t, y) + 0.3, x0, noise, times, None)
    assert off.tolist() == pytest.approx([0.09] * 3)


def test_the_perceptual_distance_by_hand_and_on_a_unet() -> None:
    # One 2-channel map of one position: (3, 4) scales to (0.6, 0.8), (0, 2) to (0, 1);
    # summed squares 0.36 + 0.04 = 0.4. A second map, the channels doubled: the same
    # unit vectors, so the mean over the two maps is 0.4 too; a map at 2x2 positions
    # averages them.
    predicted = torch.tensor([[[[3.0]], [[4.0]]]], requires_grad=True)
    target = torch.tensor([[[[0.0]], [[2.0]]]])

    def two_maps(x, labels):
        return [x, torch.cat([x, x], dim=1)]

    distance = feature_distance(two_maps, predicted, target, None)
    assert distance.tolist() == pytest.approx([0.4])
    # Scale does not count (unit vectors), only direction: the gradient along the
    # prediction itself is 0.
    distance.sum().backward()
    assert float((predicted.grad * predicted).sum()) == pytest.approx(0.0, abs=1e-6)
    # Beside the squared error, weighted; none without features.
    x_t, t, clean = torch.zeros(1, 2, 1, 1), torch.ones(1), torch.zeros(1, 2, 1, 1)
    clean[0, 1] = 2.0

    def to(value):  # a velocity whose clean prediction at t = 1 is `value`
        return lambda x, t, labels: -value

    loss = ode_distill_loss(to(predicted.detach()), x_t, t, None, clean, two_maps, 0.5)
    assert loss.tolist() == pytest.approx([(9 + 4) / 2 + 0.5 * 0.4])
    assert ode_distill_loss(to(predicted.detach()), x_t, t, None, clean).tolist() == [6.5]
    # The teacher's maps on a real UNet: the down blocks' and the middle block's; an image
    # is 0 from itself and more from another.
    from diffusers import UNet2DModel

    from rollwire.diffusion.digits import DigitsSpec, unet_config, velocity

    torch.manual_seed(0)
    features = UNetFeatures(UNet2DModel(**unet_config(DigitsSpec())), velocity)
    images, labels = torch.randn(3, 1, 8, 8), torch.tensor([0, 1, 2])
    maps = features(images, labels)
    assert [tuple(m.shape[1:]) for m in maps] == [(16, 8, 8), (32, 4, 4), (32, 4, 4)]
    assert feature_distance(features, images, images, labels).abs().max() < 1e-6
    assert (feature_distance(features, images, images.roll(1, dims=0), labels) > 0.01).all()


def test_the_dmd_direction_and_its_loss_by_hand() -> None:
    sample = torch.tensor([[2.0, 2.0], [4.0, 0.0]], requires_grad=True)
    real = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    fake = torch.tensor([[1.5, 0.5], [3.0, 2.0]])
    direction = dmd_direction(sample, real, fake)
    # Scales: mean |sample - real| = 1 and 2.
    assert direction.tolist() == [[0.5, -0.5], [0.5, 0.0]]
    assert not direction.requires_grad
    loss = dmd_generator_loss(sample, direction)
    assert loss.tolist() == pytest.approx([0.125, 0.0625])
    loss.sum().backward()
    assert torch.allclose(sample.grad, direction / 2)  # two dimensions averaged
    on_target = dmd_direction(real.clone(), real, fake)  # a zero distance is floored
    assert torch.isfinite(on_target).all()


def test_following_the_dmd_direction_with_exact_scores_reaches_the_teachers_distribution() -> None:
    """A generator x = theta + z, z ~ N(0, 1), against a teacher whose data are N(3, 1): with
    both scores exact (the fake one the generator's own distribution's), gradient steps on
    DMD's loss bring theta to 3."""
    generator = torch.Generator().manual_seed(0)
    theta = torch.zeros((), requires_grad=True)
    optimizer = torch.optim.SGD([theta], lr=0.2)
    real = gaussian_clean(3.0, 1.0)
    for _ in range(300):
        z = torch.randn(256, 1, generator=generator)
        sample = theta + z
        t = float(torch.rand((), generator=generator) * 0.96 + 0.02)
        x_t = noised(
            sample.detach(), torch.randn(256, 1, generator=generator), torch.full((256,), t)
        )
        fake = gaussian_clean(float(theta.detach()), 1.0)
        direction = dmd_direction(sample, real(x_t, t), fake(x_t, t))
        optimizer.zero_grad()
        dmd_generator_loss(sample, direction).mean().backward()
        optimizer.step()
    assert float(theta.detach()) == pytest.approx(3.0, abs=0.1)


def test_gan_terms_at_an_undecided_head() -> None:
    real, fake = torch.zeros(4, requires_grad=True), torch.zeros(3, requires_grad=True)
    head, generator = gan_head_loss(real, fake), gan_generator_loss(fake)
    assert float(head) == pytest.approx(2 * math.log(2))
    assert generator.tolist() == pytest.approx([math.log(2)] * 3)
    # The head learns from both sides: real logits up, fake logits down (sigmoid(0) / n).
    head.backward()
    assert real.grad.tolist() == pytest.approx([-0.5 / 4] * 4)
    assert fake.grad.tolist() == pytest.approx([0.5 / 3] * 3)
    # The generator's term pushes its samples' logits up.
    fake.grad = None
    generator.sum().backward()
    assert fake.grad.tolist() == pytest.approx([-0.5] * 3)


def test_few_step_sampling_fresh_and_ddim() -> None:
    assert student_times(1) == [1.0]
    assert student_times(4) == [1.0, 0.75, 0.5, 0.25]
    noise = torch.randn(5, 1, 2, 2)
    # The exact field of a point mass lands on it in one step or several, either way.
    for renoise in ("fresh", "ddim"):
        out = few_step_sample(point_mass(0.5), noise, None, student_times(4), renoise)
        assert torch.allclose(out, torch.full_like(noise, 0.5), atol=1e-5)
    # A field that says "the clean sample is half the input": 1 step from noise gives noise / 2;
    # DDIM then re-noises with the implied noise, fresh with seeded noise per sample.

    def halving(x, t, labels):
        return (x - 0.5 * x) / t.reshape(-1, 1, 1, 1)

    one = few_step_sample(halving, noise, None, [1.0])
    assert torch.allclose(one, noise / 2)
    out, inputs = few_step_sample(halving, noise, None, [1.0, 0.5], "ddim", keep=True)
    # After step 1: clean n/2, implied noise (n - 0 * n/2) / 1 = n; x = 0.5 n/2 + 0.5 n.
    assert torch.allclose(inputs[1], 0.75 * noise) and torch.allclose(out, 0.375 * noise)
    seeds = [torch.Generator().manual_seed(s) for s in range(5)]
    again = [torch.Generator().manual_seed(s) for s in range(5)]
    a = few_step_sample(halving, noise, None, [1.0, 0.5], "fresh", seeds)
    b = few_step_sample(halving, noise, None, [1.0, 0.5], "fresh", again)
    assert torch.equal(a, b) and not torch.allclose(a, out)
    with pytest.raises(ValueError, match="times must decrease"):
        few_step_sample(halving, noise, None, [0.5, 1.0])
    with pytest.raises(ValueError, match="stay above 0"):
        few_step_sample(halving, noise, None, [1.0, 0.0])


def test_the_ema_moves_a_fraction_of_the_way() -> None:
    average, model = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        average.weight.fill_(1.0)
        model.weight.fill_(3.0)
    ema_update(average, model, decay=0.9)
    assert torch.allclose(average.weight, torch.full_like(average.weight, 1.2))


def test_train_nodes_keep_some_of_a_pairs_folders_nodes_and_the_schedules_are_step_counts() -> None:
    from types import SimpleNamespace

    import numpy as np

    from rollwire.services.core.config import ConfigError, load_config
    from rollwire.trainer.pipelines.ode_distill import _rows

    pairs = SimpleNamespace(
        latents=np.arange(2 * 3, dtype=np.float32).reshape(2, 3),
        times=[1.0, 0.75, 0.5],
        labels=[4, 7],
        clean=np.array([10.0, 20.0]),
    )
    rows = _rows(pairs, [1], kept=[0, 2])
    assert [(x, t, label, end) for x, t, label, end in rows] == [
        (3, 1.0, 7, 20.0),
        (5, 0.5, 7, 20.0),
    ]
    config = load_config(None, overrides=["ode_distill.train_nodes=[0, 24]"], environ={})
    assert config.ode_distill.train_nodes == [0, 24]
    with pytest.raises(ConfigError, match="train_nodes must be some of"):
        load_config(None, overrides=["ode_distill.train_nodes=[5]"], environ={})
    dmd = load_config(None, overrides=["dmd.student_steps=[1, 2, 4]"], environ={}).dmd
    assert dmd.schedules() == [1, 2, 4]
    assert load_config(None, overrides=["dmd.student_steps=4"], environ={}).dmd.schedules() == [4]
    with pytest.raises(ConfigError, match="at least 1"):
        load_config(None, overrides=["dmd.student_steps=[2, 0]"], environ={})


def test_a_wider_student_is_the_built_in_model_of_those_channels(monkeypatch) -> None:
    from pathlib import Path

    from rollwire.diffusion import digits
    from rollwire.services.app.ode_distill import student_folder
    from rollwire.services.core.config import ConfigError, load_config

    def config(*overrides: str):
        return load_config(None, overrides=list(overrides), environ={})

    teacher = Path("/teacher")
    assert student_folder(config(), teacher) == teacher
    assert student_folder(config("trainer.model_path=/mine"), teacher) == Path("/mine")
    built = []
    monkeypatch.setattr(
        digits, "digits_model", lambda spec, threads: built.append(spec) or Path("/wide")
    )
    wide = config("ode_distill.student_channels=[32, 64]")
    assert student_folder(wide, teacher) == Path("/wide")
    assert built[0].block_out_channels == (32, 64)
    assert built[0].layers_per_block == digits.DigitsSpec().layers_per_block
    for clash in ("trainer.model_path=/mine", "ode_distill.teacher_model_path=/other"):
        both = config("ode_distill.student_channels=[32, 64]", clash)
        with pytest.raises(ValueError, match="student_channels builds"):
            student_folder(both, teacher)
    with pytest.raises(ConfigError, match="multiple of 8"):
        config("ode_distill.student_channels=[30, 64]")
