"""Distillation three ways against RL alone, on the default task: held-out greedy reward
of the student and wall time of each, in one table.

    .venv/bin/python benchmarks/distillation.py [--out DIR] [--seeds 0 1] [--opd-steps 100]

The teacher: a larger tiny model (192 wide, 4 layers, about 1.4M parameters) fine-tuned
by `rollwire sft` on right answers. The student: the default run's model (the 0.4M tiny
model warmed up on answers 60% off by one). Then:

- sequence-level: `rollwire distill generate` (3,000 training prompts x 4 answers, the
  ones scored 1 kept, with the teacher's top-8 per token), then `rollwire sft` (nll);
- token-level: `rollwire sft` with `sft.loss: forward_kl` on the same rows;
- on-policy: `rollwire train` with `trainer.algorithm.advantage: on_policy_distill` (teacher served
  on its own rollout-server, --opd-steps steps), alone and with the task reward's GRPO
  advantage added (reward_weight 1);
- RL alone: `rollwire train` with the default GRPO settings, evaluated every 5 versions;
  for each distillation row, its held-out reward at the last evaluation within that
  row's wall time (and at its end).

Wall times are whole commands (start-up, generation, training, the final evaluation)
run one at a time on this machine; the sequence- and token-level rows include the
generation. Seeds (orchestrator.sampling_seed; the SFT order seed) vary the
distillation and RL runs, not the teacher.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIG = "{hidden_size: 192, intermediate_size: 512, num_hidden_layers: 4}"


def rollwire(command: list[str], sets: list[str], timeout: float = 1800) -> tuple[str, float]:
    """Runs `rollwire COMMAND --set ...`; (stdout, seconds). Exits on failure."""
    args = [sys.executable, "-m", "rollwire.services.app.cli", *command]
    for item in sets:
        args += ["--set", item]
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout, seconds


def greedy(model: Path, out: Path) -> float:
    """Held-out greedy reward of `model` on the default evaluation set."""
    rollwire(["eval", "--checkpoint", str(model)], [f"run.output_dir={out}"])
    return json.loads((out / "evals" / model.name / "eval.json").read_text())["greedy_reward"]


def evals(run: Path) -> list[tuple[float, int, float]]:
    """(seconds since the run's first evaluation, version, reward) of a train run."""
    rows = [json.loads(line) for line in (run / "metrics" / "eval.jsonl").read_text().splitlines()]
    return [(r["time"], int(r["policy_version"]), float(r["eval_reward"])) for r in rows]


def at_wall(curve: list[tuple[float, int, float]], started: float, budget: float) -> float:
    """The reward of the last evaluation finished within `budget` seconds of `started`."""
    within = [reward for when, _, reward in curve if when - started <= budget]
    return within[-1] if within else curve[0][2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-distill")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--opd-steps", type=int, default=100)
    parser.add_argument("--rl-steps", type=int, default=160)
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "examples"))
    from chain_sum_data import write

    from rollwire.services.app.launcher import prepare_model
    from rollwire.services.core.config import RunConfig

    write(out / "data", off_by_one=0.0)
    teacher_dir = out / "teacher"
    _, teacher_seconds = rollwire(
        ["sft", "-c", str(REPO / "examples" / "sft.yaml")],
        [
            f"sft.data={out / 'data' / 'sft.jsonl'}",
            f"run.output_dir={teacher_dir}",
            f"run.tiny_model={BIG}",
            "sft.epochs=16",
            "trainer.threads=2",
        ],
    )
    teacher = teacher_dir / "final"
    teacher_reward = greedy(teacher, teacher_dir)
    student = prepare_model(RunConfig(), progress=False)
    start_reward = greedy(student, out / "student")
    print(
        f"teacher {teacher_reward:.3f} ({teacher_seconds:.0f} s to train); student start {start_reward:.3f}"
    )

    rows: dict[str, list[tuple[float, float]]] = {}
    rl_curves: list[tuple[list, float]] = []
    for seed in args.seeds:
        gen = out / f"generate-{seed}"
        _, gen_seconds = rollwire(
            ["distill", "generate"],
            [
                f"run.output_dir={gen}",
                f"trainer.model_path={teacher}",
                "distill.prompts=3000",
                "distill.samples=4",
                "distill.min_reward=1",
                "distill.top_k=8",
                f"orchestrator.sampling_seed={seed}",
            ],
        )
        for name, loss in (
            ("sequence-level (generate + sft nll)", "nll"),
            ("token-level (generate + sft forward_kl)", "forward_kl"),
        ):
            folder = out / f"{loss}-{seed}"
            _, seconds = rollwire(
                ["sft", "-c", str(REPO / "examples" / "sft.yaml")],
                [
                    f"sft.data={gen / 'distill.jsonl'}",
                    f"run.output_dir={folder}",
                    f"trainer.model_path={student}",
                    f"sft.loss={loss}",
                    f"sft.seed={seed}",
                ],
            )
            rows.setdefault(name, []).append(
                (greedy(folder / "final", folder), gen_seconds + seconds)
            )
        for name, weight in (
            ("on-policy (rollwire train, on_policy_distill)", 0.0),
            ("on-policy + task reward (reward_weight 1)", 1.0),
        ):
            opd = out / f"on-policy-{weight:g}-{seed}"
            _, seconds = rollwire(
                ["train", "-c", str(REPO / "examples" / "on_policy_distill.yaml")],
                [
                    f"run.output_dir={opd}",
                    f"distill.teacher_model_path={teacher}",
                    f"trainer.algorithm.advantage.reward_weight={weight}",
                    f"rl.max_steps={args.opd_steps}",
                    f"orchestrator.sampling_seed={seed}",
                ],
            )
            rows.setdefault(name, []).append((evals(opd)[-1][2], seconds))
        rl = out / f"rl-{seed}"
        started = time.time()
        _, seconds = rollwire(
            ["train"],
            [
                f"run.output_dir={rl}",
                f"rl.max_steps={args.rl_steps}",
                "orchestrator.eval_every=5",
                f"orchestrator.sampling_seed={seed}",
            ],
        )
        rl_curves.append((evals(rl), started))
        rows.setdefault("RL alone (rollwire train, grpo)", []).append((evals(rl)[-1][2], seconds))

    def mean(values: list[float]) -> str:
        spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
        return f"{statistics.fmean(values):.3f}{spread}"

    print(
        f"\n{len(args.seeds)} seed(s); teacher {teacher_reward:.3f}, student start {start_reward:.3f}"
    )
    print("| method | student held-out greedy | wall s | RL alone within that wall |")
    print("|---|---|---|---|")
    for name, results in rows.items():
        rewards, walls = [r for r, _ in results], [w for _, w in results]
        budget = statistics.fmean(walls)
        rl_same = [at_wall(curve, started, budget) for curve, started in rl_curves]
        print(f"| {name} | {mean(rewards)} | {budget:.0f} | {mean(rl_same)} |")
    summary = {name: results for name, results in rows.items()}
    (out / "distillation.json").write_text(
        json.dumps({"teacher": teacher_reward, "start": start_reward, "rows": summary}, indent=2)
    )


if __name__ == "__main__":
    main()
