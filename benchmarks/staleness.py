"""Does the off-policy correction hold learning up as staleness grows? The default task,
maximum staleness x correction, several seeds: a table and a plot.

    .venv/bin/python benchmarks/staleness.py [--steps 60] [--seeds 0 1 2] [--set key=value ...] [-c FILE]

Cells: rl.max_staleness in {0 (rl.mode: sync), 1, 4, 8} x trainer.algorithm.correction in
{none, tis, decoupled}. Every cell trains the default run for --steps steps with
trainer.batching.epochs_per_step --epochs (2), which makes the trainer the slow side so the
orchestrator really runs up to the bound ahead (the `staleness` column is what each
run measured), and trainer.batching.minibatches_per_step 2, so a step makes several updates and
the ratio moves. (4 epochs, tried first, overfit every batch: every cell peaked by
version 20 and fell after, whatever the correction.) Seeds are orchestrator.sampling_seed. The anchor is AReaL's report (naive PPO at
staleness 4 falls to 23.3 on AIME24 where decoupled PPO keeps 42.2, as its synchronous
run); the table says whether anything like it shows on this task.
"""

from __future__ import annotations

from grid import Cell, common_overrides, finish, output_root, parser, run_grid

STALENESS = (0, 1, 4, 8)
CORRECTIONS = ("none", "tis", "decoupled")


def main() -> None:
    options = parser(__doc__.splitlines()[0])
    options.add_argument("--staleness", type=int, nargs="+", default=list(STALENESS))
    options.add_argument("--corrections", nargs="+", default=list(CORRECTIONS))
    options.add_argument("--epochs", type=int, default=2, help="trainer.batching.epochs_per_step")
    args = options.parse_args()
    root = output_root(args, "staleness")
    common = common_overrides(
        args,
        f"trainer.batching.epochs_per_step={args.epochs}",
        "trainer.batching.minibatches_per_step=2",
    )
    cells = []
    for eta in args.staleness:
        mode = ["rl.mode=sync"] if eta == 0 else [f"rl.max_staleness={eta}"]
        for correction in args.corrections:
            name = f"staleness {eta if eta else '0 (sync)'} / {correction}"
            cells.append(
                Cell(name, [*mode, f"trainer.algorithm.correction={{type: {correction}}}"])
            )
    run_grid(cells, args.seeds, root, common, args.config)
    finish(cells, args, root, "staleness")


if __name__ == "__main__":
    main()
