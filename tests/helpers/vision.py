"""Images for the vision-language tests."""

from __future__ import annotations


def digit_images(count: int, first: int = 0) -> list:
    """`count` 8x8 digits of scikit-learn's set as PNG images by value, and their labels."""
    from rollwire.services.core.datasets import Digits

    digits = Digits.load()
    return [(digits.picture(i), digits.label(i)) for i in range(first, first + count)]


def digit_prompts(path, count: int) -> list:
    """(prompt ids, images) of `count` digit questions to the vision-language model at
    `path`, of different lengths, every third one without an image."""
    from transformers import AutoTokenizer

    from rollwire.services.core.vision import VisionSide

    side, tokenizer = VisionSide(path), AutoTokenizer.from_pretrained(path)
    out = []
    for i, (image, _) in enumerate(digit_images(count)):
        text = tokenizer(f"Which digit is this?{' ' * i}")["input_ids"]
        out.append(side.prompt_ids([image] if i % 3 else [], text))
    return out


def generated_sequence(prompt: list[int], images: list, generated):
    """A prompt and an engine's `Generation` of it as one trajectory, with its images."""
    from tests.helpers.trajectories import sequence

    return sequence(
        prompt,
        list(generated.token_ids),
        logprobs=list(generated.logprobs),
        versions=list(generated.policy_versions),
        images=images,
    )


def trainer_gap(path, prompts: list, outputs: list, device: str = "cpu") -> tuple[float, float]:
    """The largest gap between an engine's logprobs of what it generated for `prompts` and
    the trainer's `VisionLM` forward on `device`, and how many tokens were compared."""
    import torch

    from rollwire.trainer.batching import collate
    from rollwire.trainer.models.vision_lm import VisionLM

    family = VisionLM()
    model = family.load(path).to(device).eval()
    rows = [generated_sequence(*prompt, out) for prompt, out in zip(prompts, outputs, strict=True)]
    batch = collate(rows, 0)
    with torch.no_grad():
        logits = family.logits(model, batch, torch.device(device)).float().cpu()
    ours = torch.log_softmax(logits, -1).gather(-1, batch.targets[..., None])[..., 0]
    gap = float(((ours - batch.behaviour_logprobs).abs() * batch.mask).max())
    return gap, float(batch.mask.sum())
