"""The advantage estimators and policy losses side by side on the default task: held-out
reward at fixed steps and wall time, several seeds.

    .venv/bin/python benchmarks/algorithms.py [--steps 60] [--seeds 0 1 2] [--set key=value ...] [-c FILE]

Estimators (with the `ppo_clip` loss): grpo, dr_grpo (with `aggregation: constant`),
rloo, reinforce_plus_plus, lite_ppo, gae (PPO with a critic at the default settings). Losses (with `grpo` advantages): ppo_clip, gspo
(with `seq_mean_token_mean`), cispo, topr. Every cell makes two updates a step
(trainer.batching.minibatches_per_step 2), so the clipped losses differ from plain ones. Seeds
are orchestrator.sampling_seed.
"""

from __future__ import annotations

from grid import Cell, common_overrides, finish, output_root, parser, run_grid

ESTIMATORS = {
    "grpo": [],
    "dr_grpo": [
        "trainer.algorithm.aggregation=constant",
        "trainer.algorithm.aggregation_constant=10",
    ],
    "rloo": [],
    "reinforce_plus_plus": [],
    "lite_ppo": [],
    "gae": [],
}
LOSSES = {
    "gspo": ["trainer.algorithm.aggregation=seq_mean_token_mean"],
    "cispo": [],
    "topr": [],
}


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    root = output_root(args, "algorithms")
    common = common_overrides(args, "trainer.batching.minibatches_per_step=2")
    cells = [
        Cell(f"{name} + ppo_clip", [f"trainer.algorithm.advantage={{type: {name}}}", *extra])
        for name, extra in ESTIMATORS.items()
    ]
    cells += [
        Cell(f"grpo + {name}", [f"trainer.algorithm.loss={{type: {name}}}", *extra])
        for name, extra in LOSSES.items()
    ]
    run_grid(cells, args.seeds, root, common, args.config)
    finish(cells, args, root, "algorithms")


if __name__ == "__main__":
    main()
