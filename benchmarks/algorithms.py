"""The advantage estimators and policy losses side by side on the default task: held-out
reward at fixed steps and wall time, several seeds.

    .venv/bin/python benchmarks/algorithms.py [--steps 60] [--seeds 0 1 2] [--set key=value ...]

Estimators (with the `ppo_clip` loss): grpo, dr_grpo (with `aggregation: constant`),
rloo, reinforce_plus_plus, lite_ppo. Losses (with `grpo` advantages): ppo_clip, gspo
(with `seq_mean_token_mean`), cispo, topr. Every cell makes two updates a step
(trainer.minibatches_per_step 2), so the clipped losses differ from plain ones. Seeds
are orchestrator.sampling_seed.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from grid import Cell, plot, run_grid, table

ESTIMATORS = {
    "grpo": [],
    "dr_grpo": ["trainer.aggregation=constant", "trainer.aggregation_constant=10"],
    "rloo": [],
    "reinforce_plus_plus": [],
    "lite_ppo": [],
}
LOSSES = {
    "gspo": ["trainer.aggregation=seq_mean_token_mean"],
    "cispo": [],
    "topr": [],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, help="folder for the runs and the plot")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="rollwire-algorithms-"))
    common = [
        f"rl.max_steps={args.steps}",
        f"orchestrator.eval_every={max(1, args.steps // 4)}",
        "trainer.minibatches_per_step=2",
        "trainer.checkpoint_every=0",
        *args.set,
    ]
    cells = [
        Cell(f"{name} + ppo_clip", [f"trainer.advantage={{type: {name}}}", *extra])
        for name, extra in ESTIMATORS.items()
    ]
    cells += [
        Cell(f"grpo + {name}", [f"trainer.loss={{type: {name}}}", *extra])
        for name, extra in LOSSES.items()
    ]
    run_grid(cells, args.seeds, root, common)
    title = f"default task, {args.steps} steps, {len(args.seeds)} seeds"
    print(table(cells, title))
    picture = plot(cells, root / "algorithms.png", title)
    print(f"\nplot: {picture}\nruns: {root}")


if __name__ == "__main__":
    main()
