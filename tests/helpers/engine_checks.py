"""What the engine tests (vLLM, SGLang, OpenAI-compatible) share: the trainer's side of
every comparison — a float32 HF model, its logprobs of generated tokens, and weights to
swap in."""

from __future__ import annotations

import torch


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def logits_after(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The trainer's next-token logits at each generated position: [len(tokens), V]."""
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()


def recomputed(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's logprobs of `tokens` after `prompt` (temperature 1, no truncation)."""
    logprobs = torch.log_softmax(logits_after(model, prompt, tokens), dim=-1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def perturbed(model, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """New weights: each parameter moved by `scale` of its spread, reproducibly."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + scale * p.detach().std() * torch.randn(p.shape, generator=generator)
        for name, p in model.named_parameters()
    }


def load_into(model, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[name])
