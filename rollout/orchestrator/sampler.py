"""Answers of the served model, scored: what training, evaluation and distillation data share.

A `Sampler` generates from the rollout-servers and scores with the reward-servers (with
an env dataset, plays episodes against the env-servers, which may give the rewards
themselves). It knows nothing of the buffer or the trainer: the orchestrator owns one
and sends what it samples to the buffer; `rollwire eval` (`measure`) and `rollwire
distill generate` (`teacher_rows`) use one alone, so they need no buffer running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollwire.envs.base import Observation
from rollwire.proto.v1 import reward_pb2, rollout_pb2
from rollwire.rollout.orchestrator import evaluation
from rollwire.rollout.orchestrator.agent import ChatTurns, PlainTurns
from rollwire.rollout.orchestrator.servers import Servers
from rollwire.services.core.config import EnvDataset, RunConfig
from rollwire.services.core.datasets import Task, load_tasks
from rollwire.services.core.images import ImageRef, row_value


@dataclass
class Answers:
    """Responses to one prompt, scored, in sample order."""

    prompt_ids: list[int]
    images: list[ImageRef]
    """The images the prompt shows, with their offsets in `prompt_ids`."""
    outputs: list[rollout_pb2.GenerateResponse]
    texts: list[str]
    """Each response's text as the reward-server scored it (`Sampler.decode`)."""
    scores: list[reward_pb2.ScoreResult]
    generate_seconds: float
    """From the prompt's encoding to the last response."""
    score_seconds: float


class Sampler:
    """Samples the served model and scores what it says (see the module's docstring)."""

    def __init__(self, config: RunConfig, tokenizer: Any) -> None:
        self.config = config
        self.rl = config.rl
        self.settings = config.orchestrator
        self.tokenizer = tokenizer
        # None for an image run (nothing is tokenized): no stop token.
        self.eos = -1 if tokenizer is None else int(tokenizer.eos_token_id)
        self.servers = Servers(config, self.eos)
        self.vision = _vision_side(config) if tokenizer is not None else None
        self.agentic = isinstance(self.settings.dataset, EnvDataset)
        self.pool = None
        self.episodes = None  # the EpisodeRunner, once the env-servers have answered
        if self.agentic:
            from rollwire.envs.pool import EnvPool

            # Env calls get the agent's own deadline: a long tool call is not a hung server.
            env_client = config.client.model_copy(
                update={"default_timeout_seconds": self.settings.agent.env_call_timeout_seconds}
            )
            self.pool = EnvPool.from_config(config.endpoints, env_client, config.env_server)

    async def start_episodes(self) -> None:
        """Asks the env-servers what they offer (waiting for them to come up) and sets up
        the episode runner."""
        from rollwire.rollout.orchestrator.agent import EpisodeRunner, env_specs

        specs = await env_specs(
            self.pool, self.config.client.connect_timeout_seconds, self.config.endpoints.env_servers
        )
        self.episodes = EpisodeRunner(
            self.pool,
            specs,
            self.tokenizer,
            self.settings.agent,
            self.settings.max_new_tokens,
            self.settings.use_chat_template,
            self.servers.generate,
            self.servers.score_episode,
            self.vision,
        )
        env_id = self.settings.dataset.env_id
        spec = self.episodes.spec(env_id)
        if not spec.gives_reward and not self.servers.reward:
            raise ValueError(
                f"env {env_id!r} does not give rewards itself; set endpoints.reward_servers"
            )

    # ------------------------------------------------------------ prompts and responses

    def encode_prompt(self, task: Task) -> list[int]:
        """The prompt's token ids, through the chat template when it is on."""
        return self.prompt_of(task)[0]

    def prompt_of(self, task: Task) -> tuple[list[int], list[ImageRef]]:
        """The prompt's token ids, through the chat template when it is on, and the
        images it shows with their offsets: each image's placeholder goes at the start of
        the prompt's text (inside the user turn, as a chat template writes it), made as
        many pad tokens as the model reads the image as."""
        text = task.prompt(self.settings.prompt_template)
        if task.images and self.vision is None:
            raise ValueError(
                f"task {task.task_id} shows images, but the served model is not a "
                "vision-language model"
            )
        # The same rendering as an episode's first turn: the template's text, then its tokens
        # (apply_chat_template(tokenize=True) returns a mapping in transformers 5).
        if self.settings.use_chat_template:
            turns = ChatTurns(self.tokenizer, system_prompt=None, vision=self.vision)
        else:
            turns = PlainTurns(self.tokenizer, "{observation}", self.vision)
        return turns.first(Observation(text, task.images))

    def decode(self, token_ids: list[int]) -> str:
        """A response's text, without its stop token."""
        ids = token_ids[:-1] if token_ids and token_ids[-1] == self.eos else token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=self.settings.skip_special_tokens)

    async def answers(
        self, task: Task, ordinal: int | None = None, samples: int | None = None
    ) -> Answers:
        """`samples` (`rl.group_size` by default) responses to `task`'s prompt at the
        training temperature, scored; seeded from `ordinal` when `orchestrator.sampling_seed`
        is set, unseeded without one."""
        started = time.perf_counter()
        prompt_ids, images = self.prompt_of(task)
        outputs = await self.servers.generate_group(
            prompt_ids, ordinal, samples=samples, images=images
        )
        generated = time.perf_counter()
        texts = [self.decode(list(output.token_ids)) for output in outputs]
        scores = await self.servers.score(task, texts)
        return Answers(
            prompt_ids,
            images,
            outputs,
            texts,
            list(scores),
            generate_seconds=generated - started,
            score_seconds=time.perf_counter() - generated,
        )

    # ------------------------------------------------------------ evaluation

    async def greedy_reward(self, task: Task) -> float:
        """The reward of one greedy response to `task` (or episode of it): what
        evaluation measures."""
        if self.agentic:
            return (await self.episodes.run(task, 0, temperature=0.0)).reward
        prompt_ids, images = self.prompt_of(task)
        output = await self.servers.generate(prompt_ids, self.settings.max_new_tokens, 0.0, images)
        (result,) = await self.servers.score(task, [self.decode(list(output.token_ids))])
        return result.reward

    async def sampled_rewards(self, task: Task, samples: int) -> list[float]:
        """The rewards of `samples` responses to `task` (or episodes of it) at the
        training temperature: what pass@k measures."""
        if self.agentic:
            runs = [self.episodes.run(task, i, self.rl.temperature) for i in range(samples)]
            return [episode.reward for episode in await asyncio.gather(*runs)]
        answers = await self.answers(task, samples=samples)
        return [result.reward for result in answers.scores]

    async def measure(self, samples: int = 0, correct_at: float = 1.0) -> dict[str, float]:
        """The held-out numbers (`evaluation.measure`) of the model the rollout-servers
        serve now, on this run's evaluation set; for `rollwire eval`."""
        if self.settings.eval_dataset is None:
            raise ValueError("orchestrator.eval_dataset is unset: there is nothing to evaluate")
        if self.agentic:
            await self.start_episodes()
        return await evaluation.measure(
            load_tasks(self.settings.eval_dataset),
            self.greedy_reward,
            self.sampled_rewards,
            samples=samples,
            correct_at=correct_at,
            concurrency=self.settings.max_concurrent_groups * self.rl.group_size,
        )

    # ------------------------------------------------------------ distillation data

    async def teacher_rows(
        self, tasks: Sequence[Task], samples: int, min_reward: float | None, top_k: int = 0
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """The served model's answers to `tasks` (`samples` each, at the training
        temperature, seeded by `orchestrator.sampling_seed` and each task's index), scored,
        as `prompt`/`completion` rows (those scored at least `min_reward` when set), and
        counts: answers, kept, their mean reward. `top_k`:
        each kept row also carries its token ids and, per answer token, the served
        model's top_k tokens and logprobs (token-level distillation data). A task's
        images go into its rows' `images` column as a data file holds them."""
        limit = asyncio.Semaphore(self.settings.max_concurrent_groups)

        async def answer(index: int, task: Task) -> tuple[list[dict[str, Any]], list[float]]:
            async with limit:
                # Seeded from the prompt's place (orchestrator.sampling_seed): the same
                # teacher answers the same prompts alike, run after run.
                answers = await self.answers(task, index, samples=samples)
                prompt_ids = answers.prompt_ids
                scores = [result.reward for result in answers.scores]
                rows = [
                    {
                        "prompt": task.prompt(self.settings.prompt_template),
                        "completion": text,
                        "reward": reward,
                        "completion_ids": list(output.token_ids),
                    }
                    for text, reward, output in zip(
                        answers.texts, scores, answers.outputs, strict=True
                    )
                    if min_reward is None or reward >= min_reward
                ]
                if task.images:  # as a file's images column holds them (`images_of`)
                    for row in rows:
                        row["images"] = [row_value(image) for image in task.images]
                if top_k and rows:
                    scored = await self.servers.score_tokens(
                        [
                            (prompt_ids + row["completion_ids"], len(prompt_ids), answers.images)
                            for row in rows
                        ],
                        top_k,
                    )
                    for row, result in zip(rows, scored, strict=True):
                        ids, values = list(result.top_token_ids), list(result.top_logprobs)
                        row["prompt_ids"] = prompt_ids
                        row["top_ids"] = [ids[i : i + top_k] for i in range(0, len(ids), top_k)]
                        row["top_logprobs"] = [
                            values[i : i + top_k] for i in range(0, len(values), top_k)
                        ]
                if not top_k:
                    for row in rows:
                        del row["completion_ids"]
                return rows, scores

        answered = await asyncio.gather(*(answer(i, task) for i, task in enumerate(tasks)))
        rows = [row for kept, _ in answered for row in kept]
        rewards = [reward for _, scores in answered for reward in scores]
        counts = {
            "answers": float(len(rewards)),
            "kept": float(len(rows)),
            "reward_mean": sum(rewards) / max(len(rewards), 1),
        }
        return rows, counts

    async def close(self) -> None:
        """Closes the env-servers' sessions and every connection."""
        if self.pool is not None:
            await self.pool.aclose()
        await self.servers.close()


def _vision_side(config: RunConfig) -> Any:
    """The served model's image side when it is a vision-language model (the orchestrator
    reads the same folder as its tokenizer), else None."""
    from rollwire.services.core.tiny import default_model_path
    from rollwire.services.core.vision import VisionSide, is_vision_model

    path = config.rollout_server.model_path or default_model_path()
    if not is_vision_model(path):
        return None
    return VisionSide(path, config.image_inputs.limits())
