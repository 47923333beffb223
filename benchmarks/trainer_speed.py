"""The trainer's RL step against a bare PyTorch loop, and with each group's prompt once.

    .venv/bin/python benchmarks/trainer_speed.py [--model models/smollm2-135m-instruct]
        [--prompt 60] [--response 24-48] [--groups 4] [--group-size 8] [--steps 3] [--bf16]

One RL step's batch of `--groups` groups of `--group-size` samples (a `--prompt`-token
prompt per group, responses of a length drawn from `--response`, random tokens,
advantages of both signs) trains three ways, each on a fresh copy of the model:

- `bare loop`: plain PyTorch, no rollwire: per group of rows, the forward, log-softmax
  of the targets, a policy-gradient loss over the generated tokens, backward; then the
  gradient clipped and one AdamW update (torch's fused kernel). The arithmetic every
  trainer has to do.
- `rollwire, plain rows`: `rollwire.trainer.rl.policy.Policy.train_step`, the trainer
  process's own step (advantages, ratio, clip, importance weights, metrics), one
  micro-batch per group, `trainer.batching.share_prefix: false`.
- `rollwire, shared prompt`: the same with each group's prompt computed once.
- with `--bf16`, `rollwire, shared prompt, bf16`: the same in `trainer.precision: bf16`
  (autocast over float32 master weights), the question being which precision is the
  faster on this CPU.

The model is SmolLM2-135M's shape: the converted model at `--model` when it exists
(examples/smollm2_from_gguf.py), else the same configuration randomly initialised (the
time of a pass does not depend on the weights). float32, `--threads` torch threads,
nothing else running. Printed per way: tokens through the model per step, the median
step time over `--steps` steps after one warm-up step, the batch's tokens per second
and the speed against the bare loop; the largest difference between the two rollwire
ways' logprobs of the generated tokens; and what a checkpoint costs the step written
inline against in the background (`trainer.checkpointing.background`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}


def model_folder(path: Path | None, scratch: Path) -> Path:
    if path is not None and path.exists():
        return path
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rollwire.services.core.tiny import ensure_tiny_model

    torch.manual_seed(0)
    folder = scratch / "smollm2-shape"
    LlamaForCausalLM(LlamaConfig(**SMOLLM2)).save_pretrained(folder)
    # A checkpoint saves the tokenizer beside the weights: the built-in one stands in
    # (the random weights' vocabulary is only a size).
    AutoTokenizer.from_pretrained(ensure_tiny_model(scratch / "tiny")).save_pretrained(folder)
    return folder


def batch(args: argparse.Namespace, vocab: int) -> list:
    from rollwire.services.core.wire import Trajectory

    rng = np.random.default_rng(0)
    low, high = (int(x) for x in args.response.split("-"))
    out = []
    for g in range(args.groups):
        prompt = rng.integers(10, vocab, args.prompt).tolist()
        for s in range(args.group_size):
            response = rng.integers(10, vocab, int(rng.integers(low, high + 1))).tolist()
            ids = np.array(prompt + response, np.int32)
            mask = np.array([0] * len(prompt) + [1] * len(response), np.uint8)
            out.append(
                Trajectory(
                    trajectory_id=f"{g}/{s}",
                    group_id=str(g),
                    task_id=str(g),
                    sample_index=s,
                    prompt_ordinal=g,
                    source="bench",
                    domain="bench",
                    token_ids=ids,
                    loss_mask=mask,
                    behaviour_logprobs=np.where(mask == 1, -3.0, 0).astype(np.float32),
                    policy_versions=np.where(mask == 1, 0, -1).astype(np.int64),
                    reward=float(s % 2),
                )
            )
    return out


def measure(model: Path, share: bool, args: argparse.Namespace, precision: str = "fp32") -> dict:
    from rollwire.services.core.config import RLSection, TrainerConfig
    from rollwire.trainer.batching import collate
    from rollwire.trainer.rl.policy import Policy
    from rollwire.trainer.shared_prefix import share_prefixes, worth_sharing

    config = TrainerConfig(
        batching={"micro_batch_size": args.group_size, "share_prefix": share},
        optimizer={"learning_rate": 1e-7},
        threads=args.threads,
        precision=precision,
    )
    policy = Policy(model, config, RLSection(group_size=args.group_size, max_steps=args.steps + 2))
    rows = batch(args, policy.learner.model.config.vocab_size)
    tokens = 0
    for start in range(0, len(rows), args.group_size):
        part = collate(rows[start : start + args.group_size], policy.learner.pad_token_id)
        layout = share_prefixes(part) if share else None
        used = layout is not None and worth_sharing(layout, part, policy.learner.model)
        tokens += layout.tokens if used else int(part.attention.sum())
    whole = collate(rows, policy.learner.pad_token_id)
    with torch.no_grad():
        logprobs = policy.step.updater.logprobs(policy.learner.model, whole)[whole.mask.bool()]
    times = []
    for step in range(args.steps + 1):
        started = time.perf_counter()
        policy.step.train_step(rows, trainer_version=step)
        times.append(time.perf_counter() - started)
    result = {"tokens": tokens, "seconds": statistics.median(times[1:]), "logprobs": logprobs}
    # The checkpoint's cost on the step's path, written inline and in the background.
    if share and precision == "fp32":
        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            policy.save_checkpoint(Path(scratch) / "inline", args.steps, args.steps)
            result["inline"] = time.perf_counter() - started
            started = time.perf_counter()
            write = policy.checkpoint_writer(Path(scratch) / "background", args.steps, args.steps)
            result["copy"] = time.perf_counter() - started
            started = time.perf_counter()
            write()
            result["write"] = time.perf_counter() - started
    return result


def bare_loop(model_path: Path, args: argparse.Namespace) -> dict:
    """The same step in plain PyTorch (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
    # torch's fused AdamW, as the trainer builds it on CPU: the best plain PyTorch has.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, weight_decay=0.0, fused=True)
    rows = batch(args, model.config.vocab_size)
    groups = []
    for start in range(0, len(rows), args.group_size):
        part = rows[start : start + args.group_size]
        width = max(t.num_tokens for t in part)
        ids = torch.zeros((len(part), width), dtype=torch.long)
        attention = torch.zeros_like(ids)
        mask = torch.zeros((len(part), width), dtype=torch.float32)
        for row, t in enumerate(part):
            ids[row, : t.num_tokens] = torch.from_numpy(t.token_ids.astype(np.int64))
            attention[row, : t.num_tokens] = 1
            mask[row, : t.num_tokens] = torch.from_numpy(t.loss_mask.astype(np.float32))
        advantages = torch.tensor([t.reward - 0.5 for t in part])
        groups.append((ids, attention, mask[:, 1:], advantages))
    generated = sum(float(g[2].sum()) for g in groups)
    times = []
    for _ in range(args.steps + 1):
        started = time.perf_counter()
        for ids, attention, mask, advantages in groups:
            logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
            logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            taken = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)
            ratio = torch.exp(taken - taken.detach())
            loss = -(ratio * advantages[:, None] * mask).sum() / generated
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    tokens = sum(int(g[1].sum()) for g in groups)
    return {"tokens": tokens, "seconds": statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--prompt", type=int, default=60)
    parser.add_argument("--response", default="24-48")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="also the shared prompt in bf16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        model = model_folder(args.model, Path(scratch))
        shown = model if model == args.model else "SmolLM2-135M's shape, random weights"
        print(
            f"model: {shown}; {args.groups} groups x {args.group_size}, prompt {args.prompt} "
            f"tokens, responses {args.response}; float32 unless said, {args.threads} threads"
        )
        bare = bare_loop(model, args)
        plain = measure(model, False, args)
        shared = measure(model, True, args)
        bf16 = measure(model, True, args, "bf16") if args.bf16 else None
    batch_tokens = bare["tokens"]
    print()
    print(
        "| way | tokens through the model a step | step (s) | batch tokens/s | speed vs bare loop |"
    )
    print("|---|---|---|---|---|")
    ways = [
        ("bare loop", bare),
        ("rollwire, plain rows", plain),
        ("rollwire, shared prompt", shared),
    ]
    if bf16 is not None:
        ways.append(("rollwire, shared prompt, bf16", bf16))
    for name, row in ways:
        speed = bare["seconds"] / row["seconds"]
        rate = batch_tokens / row["seconds"]
        print(f"| {name} | {row['tokens']} | {row['seconds']:.2f} | {rate:.0f} | {speed:.2f}x |")
    gap = float((shared["logprobs"] - plain["logprobs"]).abs().max())
    count = plain["logprobs"].numel()
    print(f"\nlargest logprob difference over {count} generated tokens: {gap:.2e}")
    if bf16 is not None:
        gap = float((bf16["logprobs"] - shared["logprobs"]).abs().max())
        print(f"largest logprob difference, bf16 against float32: {gap:.2e}")
    print(
        f"a checkpoint on the step's path: written inline {shared['inline']:.2f} s; "
        f"in the background {shared['copy']:.2f} s to copy the weights and optimizer state, "
        f"then {shared['write']:.2f} s written by a thread while the next step runs"
    )


if __name__ == "__main__":
    main()
