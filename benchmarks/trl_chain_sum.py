"""The same chain_sum RL run with Hugging Face TRL's GRPOTrainer and with rollwire
(asynchronous, then synchronous), side by side, evaluated by one piece of code.

    .venv/bin/pip install trl==1.13.0        # not a rollwire dependency
    .venv/bin/python benchmarks/trl_chain_sum.py [--steps 120] [--systems ...] [--set K=V]

Every system starts from the same model: the tiny Qwen2 shape below (2.3M parameters),
warmed up by rollwire's own supervised warm-up (`prepare_model`, cached), and trains on
the same prompts (the training set without any held-out prompt), 16 prompts x 8
samples a step, learning rate 1e-4, temperature 1, the same completion length, the
same binary reward (reasoning-gym's score_answer on the tagged answer), clipping and
KL settings from rollwire's config, the same precision (float32 unless
`trainer.precision` says bf16; GRPOConfig's own default is bf16). TRL runs in one
process with two torch threads; rollwire's services share the same two cores, with
`run.cpu_threads=2` and two rollout-servers of one thread each
(`run.local_rollout_servers=2`: a 2.3M model generates faster as two one-thread
processes than as one process on two threads);
sync: the trainer's step on both cores, then generation on both servers; async: the
trainer on one thread beside them. `--set run.local_rollout_servers=1` for one server.

"training s" is TRL's `trainer.train()` and rollwire's trainer clock at its last
step (both include generating the first batch, neither the evaluations). The
evaluation, the same function for all, runs in this process on the 200 held-out
prompts: greedy accuracy, sampled accuracy (8 samples a prompt, temperature 1, no
top-k or top-p) and pass@8, before and after. One seed each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rollwire.reward.scorers import ScoreInput, reasoning_gym_score
from rollwire.services.app.launcher import prepare_model
from rollwire.services.core.config import load_config
from rollwire.services.core.datasets import load_tasks, task_at, training_tasks
from rollwire.services.core.files import latest_checkpoint

SHAPE = "{hidden_size: 256, intermediate_size: 768, num_hidden_layers: 3, num_attention_heads: 8}"
SETTING = [
    f"run.tiny_model={SHAPE}",
    "rl.groups_per_step=16",
    "rl.group_size=8",
    "trainer.optimizer.learning_rate=1e-4",
]
SAMPLES = 8
THREADS = 2


def evaluate(model, tokenizer, tasks, template: str, max_new_tokens: int) -> dict[str, float]:
    """Greedy accuracy, sampled accuracy and pass@SAMPLES on `tasks` (seeded)."""

    def correct(task, ids) -> float:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        item = ScoreInput(text, task.reference, task.question, task.metadata)
        return reasoning_gym_score(item).reward

    model.eval()
    torch.manual_seed(0)
    greedy = sampled = passed = 0.0
    with torch.inference_mode():
        for start in range(0, len(tasks), 50):
            chunk = tasks[start : start + 50]
            encoded = tokenizer(
                [t.prompt(template) for t in chunk],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            )
            width = encoded["input_ids"].shape[1]
            common = {"max_new_tokens": max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
            out = model.generate(**encoded, do_sample=False, **common)
            greedy += sum(correct(t, ids) for t, ids in zip(chunk, out[:, width:], strict=True))
            out = model.generate(
                **encoded,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=SAMPLES,
                **common,
            )
            for index, task in enumerate(chunk):
                rows = out[index * SAMPLES : (index + 1) * SAMPLES, width:]
                scores = [correct(task, ids) for ids in rows]
                sampled += sum(scores) / SAMPLES
                passed += float(max(scores) >= 1.0)
    model.train()
    return {
        "greedy": greedy / len(tasks),
        "sampled": sampled / len(tasks),
        f"pass@{SAMPLES}": passed / len(tasks),
    }


def run_trl(config, model_path: Path, steps: int, out: Path) -> tuple[float, Path]:
    """TRL's GRPOTrainer on the same start, prompts and settings; (training s, model folder)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    settings, rl = config.orchestrator, config.rl
    pool = training_tasks(settings.dataset, settings.eval_dataset)
    rows = [task_at(pool, ordinal) for ordinal in range(steps * rl.groups_per_step)]
    dataset = Dataset.from_list(
        [
            {
                "prompt": t.prompt(settings.prompt_template),
                "answer": t.reference,
                "question": t.question,
                "metadata": json.dumps(t.metadata),
            }
            for t in rows
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path)

    def reward(prompts, completions, answer, question, metadata, **_):
        return [
            reasoning_gym_score(
                ScoreInput(c.replace(tokenizer.eos_token, ""), a, q, json.loads(m))
            ).reward
            for c, a, q, m in zip(completions, answer, question, metadata, strict=True)
        ]

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        processing_class=tokenizer,
        train_dataset=dataset,
        args=GRPOConfig(
            output_dir=str(out / "trl"),
            use_cpu=True,
            # rollwire's trainer computes in float32 here (trainer.precision: fp32);
            # GRPOConfig defaults to bf16 autocast, which this CPU (no native bf16
            # matmul) runs 15x slower: 10.3 s a step against 0.69 s in float32.
            bf16=config.trainer.precision == "bf16",
            max_steps=steps,
            per_device_train_batch_size=rl.groups_per_step * rl.group_size,
            num_generations=rl.group_size,
            max_completion_length=settings.max_new_tokens,
            learning_rate=config.trainer.optimizer.learning_rate,
            lr_scheduler_type="constant",
            warmup_steps=0,
            temperature=rl.temperature,
            top_k=0,
            top_p=1.0,
            beta=config.trainer.algorithm.kl.coef,
            epsilon=config.trainer.algorithm.loss.clip_low,
            epsilon_high=config.trainer.algorithm.loss.clip_high,
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            seed=config.run.seed,
            dataloader_num_workers=0,
            shuffle_dataset=False,
        ),
    )
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    folder = out / "trl" / "final"
    trainer.save_model(str(folder))
    return seconds, folder


def run_rollwire(
    mode: str, steps: int, out: Path, cache: str, overrides: list[str]
) -> tuple[float, Path]:
    """`rollwire train` in `mode` with the same settings, then `overrides`; (training s,
    final checkpoint)."""
    run_dir = out / mode
    command = [sys.executable, "-m", "rollwire.services.app.cli", "train"]
    for item in (
        *SETTING,
        f"rl.max_steps={steps}",
        f"rl.mode={mode}",
        f"run.cpu_threads={THREADS}",
        f"run.local_rollout_servers={THREADS}",
        f"run.output_dir={run_dir}",
        "orchestrator.eval_every=100000",  # its own evaluations: at the start and the end only
        *overrides,
    ):
        command += ["--set", item]
    env = {**os.environ, "ROLLWIRE_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, env=env)
    if done.returncode != 0:
        raise SystemExit(f"rollwire {mode} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rows = (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()
    seconds = json.loads(rows[-1])["elapsed_seconds"]
    breakdown = [line for line in done.stdout.splitlines() if line.startswith("trainer step")]
    print(f"rollwire {mode}: " + (breakdown[0] if breakdown else ""), flush=True)
    return seconds, latest_checkpoint(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument(
        "--systems", nargs="+", default=["trl", "async", "sync"], choices=["trl", "async", "sync"]
    )
    parser.add_argument("--out", type=Path, help="folder for the runs (default: a temp dir)")
    rollwire_only = "KEY=VALUE for the rollwire runs, after the shared settings (repeatable)"
    parser.add_argument("--set", dest="overrides", action="append", default=[], help=rollwire_only)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    out = args.out or Path(tempfile.mkdtemp(prefix="trl-chain-sum-"))
    cache = os.environ.get("ROLLWIRE_CACHE_DIR", str(Path.home() / ".cache" / "rollwire"))
    os.environ["ROLLWIRE_CACHE_DIR"] = cache
    config = load_config(None, [*SETTING, f"rl.max_steps={args.steps}"])
    start = prepare_model(config, progress=True)
    tokenizer = AutoTokenizer.from_pretrained(start)
    tokenizer.padding_side = "left"
    settings = config.orchestrator
    held_out = list(load_tasks(settings.eval_dataset))

    def measure(folder: Path) -> dict[str, float]:
        model = AutoModelForCausalLM.from_pretrained(folder)
        return evaluate(
            model, tokenizer, held_out, settings.prompt_template, settings.max_new_tokens
        )

    before = measure(start)
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(start).parameters())
    print(f"start: {start} ({parameters / 1e6:.1f}M parameters), held-out {before}", flush=True)
    results = {}
    for system in args.systems:
        if system == "trl":
            seconds, folder = run_trl(config, start, args.steps, out)
        else:
            seconds, folder = run_rollwire(system, args.steps, out, cache, args.overrides)
        results[system] = (seconds, measure(folder))
        print(f"{system}: {seconds:.0f} s, held-out {results[system][1]}", flush=True)

    completions = args.steps * config.rl.groups_per_step * config.rl.group_size
    base = results.get("trl", (None,))[0]
    print(
        f"\nchain_sum, {args.steps} steps of {config.rl.groups_per_step} x {config.rl.group_size}, "
        f"{parameters / 1e6:.1f}M parameters, {os.cpu_count()} cores, one seed; held-out: "
        f"{len(held_out)} prompts"
        + (f"; rollwire with {' '.join(args.overrides)}" if args.overrides else "")
        + "\n"
    )
    print(
        "| system | training s | vs TRL | completions/s | greedy before -> after "
        f"| sampled before -> after | pass@{SAMPLES} before -> after |"
    )
    print("|---|---:|---:|---:|---|---|---|")
    names = {"trl": "TRL GRPOTrainer", "async": "rollwire async", "sync": "rollwire sync"}
    for system, (seconds, after) in results.items():
        ratio = f"{seconds / base:.2f}x" if base else "n/a"
        cells = " | ".join(f"{before[k]:.3f} -> {after[k]:.3f}" for k in before)
        print(
            f"| {names[system]} | {seconds:.0f} | {ratio} | {completions / seconds:.0f} | {cells} |"
        )
    print(f"\nruns in {out}")


if __name__ == "__main__":
    main()
