"""Real tiny judges and reward models, built offline for the judge tests and the run test."""

from __future__ import annotations

from pathlib import Path

import torch

from rollwire.services.core.tiny import TinySpec, build_tiny_model, build_tokenizer

JUDGE_TEMPLATE = "{prompt}|{reference}|{response}|"
"""Short enough for the tiny model's 256-token context."""
SCALE = TinySpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2)


def judge_examples(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(rubric, reply) per (question, answer): the right answer scores 9, a wrong one 1."""
    examples = []
    for question, answer in pairs:
        wrong = str(int(answer) + 1)
        for response, score in ((answer, 9), (wrong, 1)):
            rubric = JUDGE_TEMPLATE.format(prompt=question, reference=answer, response=response)
            examples.append((rubric, f"Score: {score}"))
    return examples


def train_judge(
    folder: Path, examples: list[tuple[str, str]], steps: int = 300, lr: float = 3e-3
) -> Path:
    """The tiny model fine-tuned to reply `reply` (then end) to each `rubric`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tiny_model(folder, SCALE)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rows = []
    for rubric, reply in examples:
        prompt = tokenizer(rubric, add_special_tokens=False).input_ids
        target = [*tokenizer(reply, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        rows.append((prompt + target, [-100] * len(prompt) + target))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(i) for i, _ in rows])[:, None]).long()
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    return folder


def tiny_reward_model(folder: Path, num_labels: int = 1) -> Path:
    """A random Llama sequence classifier with the character tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
