"""Train/inference mismatch: an engine's logprobs against the trainer's recomputation.

    rollwire mismatch HOST:PORT [--model PATH] [--requests 32] [--max-new-tokens 32]

Asks a running rollout-server (any engine) for sampled responses with their
per-token logprobs, recomputes the logprob of every sampled token with the
trainer's forward pass on the same weights (the model the server reports, or
--model), and prints the largest and mean absolute difference and the KL of the
engine's distribution to the trainer's on the engine's samples (k3 estimator).
A GRPO run that is stable with one engine and collapses with another often
shows here first; during training the same numbers are the `mismatch_*`
metrics in metrics/trainer.jsonl (over tokens sampled from the weights being
trained).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from rollwire.proto.v1 import rollout_pb2, rollout_pb2_grpc
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import ClientConfig
from rollwire.trainer.math.algorithms import token_logprobs


@dataclass
class MismatchReport:
    engine: str
    model: str
    policy_version: int
    requests: int
    tokens: int
    abs_max: float
    abs_mean: float
    kl: float

    def table(self) -> str:
        rows = [
            ("engine", self.engine),
            ("model", self.model),
            ("policy version", str(self.policy_version)),
            ("responses / tokens", f"{self.requests} / {self.tokens}"),
            ("max |logp engine - logp trainer|", f"{self.abs_max:.3g}"),
            ("mean |logp engine - logp trainer|", f"{self.abs_mean:.3g}"),
            ("KL(engine || trainer) per token", f"{self.kl:.3g}"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


async def measure(
    address: str,
    model_path: str | Path | None = None,
    requests: int = 32,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    prompt_tokens: int = 8,
    seed: int = 0,
    client: ClientConfig | None = None,
    device: str = "cpu",
    precision: str = "fp32",
) -> MismatchReport:
    """Samples `requests` responses from the server at `address` and compares logprobs with
    the trainer's forward on `device`, in float32 or (`precision` bf16) under bfloat16
    autocast on float32 weights, as the trainer computes."""
    from transformers import AutoModelForCausalLM

    async with open_channel(address, client) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        status = await stub.GetStatus(rollout_pb2.RolloutStatusRequest())
        path = Path(model_path or status.model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        vocab = int(model.get_input_embeddings().weight.shape[0])
        rng = random.Random(seed)
        prompts = [[rng.randrange(1, vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
        sampling = rollout_pb2.SamplingParams(
            temperature=temperature, max_new_tokens=max_new_tokens
        )
        replies = await asyncio.gather(
            *(
                stub.Generate(
                    rollout_pb2.GenerateRequest(
                        request_id=f"mismatch-{i}",
                        prompt_token_ids=prompt,
                        sampling=rollout_pb2.SamplingParams(
                            temperature=sampling.temperature,
                            max_new_tokens=sampling.max_new_tokens,
                            seed=seed * 100_003 + i,
                        ),
                    )
                )
                for i, prompt in enumerate(prompts)
            )
        )
    differences, kls = [], []
    device_type = torch.device(device).type
    with torch.no_grad():
        for prompt, reply in zip(prompts, replies, strict=True):
            tokens = list(reply.token_ids)
            if not tokens:
                continue
            ids = torch.tensor([prompt + tokens], device=device)
            with torch.autocast(device_type, torch.bfloat16, enabled=precision == "bf16"):
                logits = model(input_ids=ids).logits[:, :-1]
            ours = token_logprobs(logits, ids[:, 1:], temperature)[0, len(prompt) - 1 :].cpu()
            theirs = torch.tensor(list(reply.logprobs), dtype=torch.float32)
            log_ratio = ours - theirs
            differences.append(log_ratio.abs())
            kls.append(log_ratio.exp() - 1 - log_ratio)
    every = torch.cat(differences) if differences else torch.zeros(0)
    return MismatchReport(
        engine=status.engine,
        model=str(path),
        policy_version=status.policy_version,
        requests=len(replies),
        tokens=int(every.numel()),
        abs_max=float(every.max()) if every.numel() else 0.0,
        abs_mean=float(every.mean()) if every.numel() else 0.0,
        kl=float(torch.cat(kls).mean()) if kls else 0.0,
    )
