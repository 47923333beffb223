"""Episodes whose observations are pictures: every picture goes into the context as the
policy's own placeholders, to each later turn's generation and into the trajectory where
the trainer finds it; a picture the policy cannot be shown fails the episode clearly."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from rollwire.envs.base import Observation
from rollwire.envs.client import LocalEnvs
from rollwire.envs.demos import demo_batches
from rollwire.envs.pictures import DigitLock
from rollwire.envs.pool import EnvPool
from rollwire.proto.v1 import rollout_pb2
from rollwire.rollout.orchestrator.agent import EpisodeFailed, EpisodeRunner, PlainTurns
from rollwire.services.core.config import AgentConfig, EnvDataset, EnvServerConfig
from rollwire.services.core.datasets import EnvTasks
from rollwire.services.core.images import ImageRef
from rollwire.services.core.metrics import COUNTERS

SEED = 11


@pytest.fixture(scope="module")
def vision(tiny_vlm_path):
    from rollwire.services.core.vision import VisionSide

    return VisionSide(tiny_vlm_path)


@pytest.fixture(scope="module")
def tokenizer(tiny_vlm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_vlm_path)


class Policy:
    """Stands in for the rollout-server: answers the scripted texts, keeping what it was shown."""

    def __init__(self, tokenizer: Any, actions: list[str]) -> None:
        self.tokenizer, self.actions = tokenizer, list(actions)
        self.shown: list[tuple[list[int], list[ImageRef]]] = []

    async def __call__(
        self, prompt: list[int], max_new_tokens: int, temperature: float, images: list
    ) -> rollout_pb2.GenerateResponse:
        self.shown.append((list(prompt), list(images)))
        ids = [*self.tokenizer(self.actions.pop(0))["input_ids"], self.tokenizer.eos_token_id]
        return rollout_pb2.GenerateResponse(
            token_ids=ids,
            logprobs=[-0.1] * len(ids),
            policy_versions=[2] * len(ids),
            finish_reason=rollout_pb2.FINISH_REASON_STOP,
        )


def lock_task(**kwargs: Any):
    return EnvTasks(EnvDataset(env_id="digit_lock", env_kwargs={"dials": 2, **kwargs}, seed=SEED))[
        0
    ]


def labels_of(seed: int) -> list[int]:
    env = DigitLock(dials=2)
    env.reset(seed)
    return [env.digits.label(index) for index in env.shown]


async def play(tokenizer, policy, vision, backend=None, **settings: Any):
    pool = EnvPool([backend or LocalEnvs(EnvServerConfig())])
    runner = EpisodeRunner(
        pool,
        await pool.specs(),
        tokenizer,
        AgentConfig(**{"max_turns": 3, "max_episode_tokens": 400, **settings}),
        8,
        False,
        policy,
        None,
        vision,
    )
    return await runner.run(lock_task(max_turns=3), 0, 1.0)


def test_each_picture_goes_to_every_later_turn_and_into_the_trajectory(tokenizer, vision) -> None:
    first, second = labels_of(SEED)
    policy = Policy(tokenizer, [str((first + 1) % 10), str(first), str(second)])
    trajectory = asyncio.run(play(tokenizer, policy, vision))

    assert trajectory.step_rewards.tolist() == [0.0, 0.5, 0.5]
    assert trajectory.finish_reason == "terminated" and trajectory.reward == 1.0
    # Dial 1 shown, shown again after the miss, then dial 2: three pictures, each turn
    # generated with every picture shown so far, at the same offsets.
    assert [len(images) for _, images in policy.shown] == [1, 2, 3]
    ids = trajectory.token_ids.tolist()
    for prompt, images in policy.shown:
        assert prompt == ids[: len(prompt)]
        assert images == trajectory.images[: len(images)]
    pictures = trajectory.images
    assert pictures[0].data == pictures[1].data != pictures[2].data
    # Each offset starts a run of pad tokens, the image's own count, after the model's
    # start marker; the pads are context (no loss), and the trainer's check agrees.
    counts = vision.token_counts(vision.check(ids, pictures))
    for image, count in zip(pictures, counts, strict=True):
        at = image.offset
        assert ids[at - 1] == vision.start and ids[at + count] == vision.end
        assert ids[at : at + count] == [vision.image_token] * count
        assert set(trajectory.loss_mask[at : at + count].tolist()) == {0}
    # The picture comes before the observation's text, inside the same turn.
    text = tokenizer.decode(ids[pictures[1].offset + counts[1] + 1 :])
    assert text.startswith("no. dial 1/2?")


def test_a_text_policy_shown_a_picture_fails_the_episode_saying_why(tokenizer) -> None:
    before = COUNTERS.get("orchestrator_refused_images", env_id="digit_lock")
    with pytest.raises(EpisodeFailed, match="not a vision-language model"):
        asyncio.run(play(tokenizer, Policy(tokenizer, []), vision=None))
    assert COUNTERS.get("orchestrator_refused_images", env_id="digit_lock") == before + 1


def test_an_env_sending_a_broken_picture_fails_the_episode_saying_which(tokenizer, vision) -> None:
    class Broken(LocalEnvs):
        async def reset(self, env_id: str, seed: int | None = None, kwargs: dict | None = None):
            session, _, info = await super().reset(env_id, seed, kwargs)
            return session, Observation("dial 1/2?", (ImageRef(b"GIF89a nope", "gif"),)), info

    with pytest.raises(EpisodeFailed, match="'digit_lock' on local sent an image the policy"):
        asyncio.run(play(tokenizer, Policy(tokenizer, []), vision, Broken(EnvServerConfig())))


def test_demonstrations_with_pictures_place_them_as_the_episodes_do(tokenizer, vision) -> None:
    batch = demo_batches(
        "digit_lock",
        {"dials": 2, "max_turns": 3},
        range(100, 200),
        tokenizer,
        lambda: PlainTurns(tokenizer, "{observation}\n", vision),
        {"off_by_one_rate": 1.0},  # always wrong first: every episode shows three pictures
        max_turns=3,
        max_tokens=400,
    )
    examples = batch(random.Random(0), 3)
    for ids, taught, images in examples:
        assert len(images) == 3 and len(ids) == len(taught)
        vision.check(ids, images)  # pads and pictures agree
        actions = tokenizer.decode([t for t, m in zip(ids, taught, strict=True) if m])
        assert [len(part) for part in actions.split("<eos>") if part] == [1, 1, 1]
        pads = {i for i, token in enumerate(ids) if token == vision.image_token}
        assert not pads & {i for i, m in enumerate(taught) if m}
