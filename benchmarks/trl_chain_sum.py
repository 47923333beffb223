"""The same chain_sum RL run with Hugging Face TRL's GRPOTrainer, for comparison.

    .venv/bin/pip install trl==1.16.0
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/trl_chain_sum.py --steps 100

Starts from the same warmed-up model `rollwire train` uses (built by the same
code and cached), with the same prompts, group size, prompts per step,
learning rate, completion length, reward (reasoning-gym's score_answer on the
tagged answer) and held-out evaluation (greedy, the same 200 prompts), and
prints the held-out reward against wall time. TRL runs in one process on both
cores; rollwire's services share the same two cores.
"""

from __future__ import annotations

import argparse
import time

import torch

from rollwire.reward.scorers import ScoreInput, reasoning_gym_score
from rollwire.services.app.launcher import prepare_model
from rollwire.services.core.config import load_config
from rollwire.services.core.datasets import load_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-c", "--config", help="rollwire run config to mirror (default: the built-in default)"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=20)
    args = parser.parse_args()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    config = load_config(args.config, args.overrides)
    model_path = prepare_model(config, progress=False)
    settings, rl = config.orchestrator, config.rl
    template = settings.prompt_template
    train_tasks = load_tasks(settings.dataset)
    eval_tasks = list(load_tasks(settings.eval_dataset))
    count = args.steps * rl.groups_per_step
    rows = [train_tasks[i] for i in range(count)]
    dataset = Dataset.from_list(
        [
            {
                "prompt": t.prompt(template),
                "answer": t.reference,
                "question": t.question,
                "metadata": t.metadata,
            }
            for t in rows
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path)

    def reward(prompts, completions, answer, question, metadata, **_):
        return [
            reasoning_gym_score(ScoreInput(c.replace(tokenizer.eos_token, ""), a, q, m)).reward
            for c, a, q, m in zip(completions, answer, question, metadata, strict=True)
        ]

    def evaluate(current) -> float:
        current.eval()
        total = 0.0
        with torch.inference_mode():
            for start in range(0, len(eval_tasks), 50):
                chunk = eval_tasks[start : start + 50]
                encoded = tokenizer(
                    [t.prompt(template) for t in chunk],
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=False,
                )
                out = current.generate(
                    **encoded,
                    do_sample=False,
                    max_new_tokens=settings.max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                )
                for task, ids in zip(chunk, out[:, encoded["input_ids"].shape[1] :], strict=True):
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    total += reasoning_gym_score(
                        ScoreInput(text, task.reference, task.question, task.metadata)
                    ).reward
        current.train()
        return total / len(eval_tasks)

    history = [(0, 0.0, evaluate(model))]
    started = time.perf_counter()
    evaluation_seconds = 0.0

    class Evaluate(TrainerCallback):
        def on_step_end(self, arguments, state, control, model=None, **kwargs):
            nonlocal evaluation_seconds
            if state.global_step % args.eval_every == 0:
                eval_started = time.perf_counter()
                training_seconds = eval_started - started - evaluation_seconds
                history.append((state.global_step, training_seconds, evaluate(model)))
                evaluation_seconds += time.perf_counter() - eval_started

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        processing_class=tokenizer,
        train_dataset=dataset,
        callbacks=[Evaluate()],
        args=GRPOConfig(
            output_dir="/tmp/trl-chain-sum",
            use_cpu=True,
            max_steps=args.steps,
            per_device_train_batch_size=rl.groups_per_step * rl.group_size,
            num_generations=rl.group_size,
            max_completion_length=settings.max_new_tokens,
            learning_rate=config.trainer.learning_rate,
            lr_scheduler_type="constant",
            warmup_steps=0,
            temperature=rl.temperature,
            beta=config.trainer.kl.coef,
            epsilon=config.trainer.loss.clip_low,
            epsilon_high=config.trainer.loss.clip_high,
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            seed=config.run.seed,
            dataloader_num_workers=0,
        ),
    )
    trainer.train()
    print("step  training seconds  held-out eval reward")
    for step, seconds, value in history:
        print(f"{step:>4}  {seconds:>16.1f}  {value:.3f}")
    print(
        f"total wall {time.perf_counter() - started:.1f}s (evaluation {evaluation_seconds:.1f}s of it)"
    )


if __name__ == "__main__":
    main()
