"""Real tiny judges and reward models, built offline for the judge tests and the run test."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
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


class _Judge(BaseHTTPRequestHandler):
    replies: dict[str, dict] = {}
    seen: list[tuple[str, dict]] = []

    def do_GET(self) -> None:
        self._reply(self.path, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._reply(self.path, body)

    def _reply(self, path: str, body: dict) -> None:
        self.seen.append((path, body))
        status, reply = self.replies.get(path, (404, {"error": "no route"}))
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def openai_judge():
    """A stub OpenAI-compatible judge on loopback: (base URL, handler); set
    `handler.replies[path] = (status, body)`, read `handler.seen`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    _Judge.replies, _Judge.seen = {}, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", _Judge
    server.shutdown()
    server.server_close()


def chat_reply(content: str | None = None, top: list[tuple[str, float]] | None = None) -> dict:
    choice: dict = {"message": {"role": "assistant", "content": content}}
    if top is not None:
        choice["logprobs"] = {
            "content": [{"top_logprobs": [{"token": t, "logprob": lp} for t, lp in top]}]
        }
    return {"choices": [choice]}
