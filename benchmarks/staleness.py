"""Does the off-policy correction hold learning up as staleness grows? The default task,
maximum staleness x correction, several seeds: a table and a plot.

    .venv/bin/python benchmarks/staleness.py [--steps 60] [--seeds 0 1 2] [--set key=value ...]

Cells: rl.max_staleness in {0 (rl.mode: sync), 1, 4, 8} x trainer.correction in
{none, tis, decoupled}. Every cell trains the default run for --steps steps with
trainer.epochs_per_step 4, which makes the trainer the slow side so the orchestrator
really runs up to the bound ahead (the `staleness` column is what each run measured),
and trainer.minibatches_per_step 2, so a step makes several updates and the ratio
moves. Seeds are orchestrator.sampling_seed. The anchor is AReaL's report (naive PPO at
staleness 4 falls to 23.3 on AIME24 where decoupled PPO keeps 42.2, as its synchronous
run); the table says whether anything like it shows on this task.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from grid import Cell, plot, run_grid, table

STALENESS = (0, 1, 4, 8)
CORRECTIONS = ("none", "tis", "decoupled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="+", default=list(STALENESS))
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, help="folder for the runs and the plot")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="rollwire-staleness-"))
    common = [
        f"rl.max_steps={args.steps}",
        f"orchestrator.eval_every={max(1, args.steps // 4)}",
        "trainer.epochs_per_step=4",
        "trainer.minibatches_per_step=2",
        "trainer.checkpoint_every=0",
        *args.set,
    ]
    cells = []
    for eta in args.staleness:
        mode = ["rl.mode=sync"] if eta == 0 else [f"rl.max_staleness={eta}"]
        for correction in args.corrections:
            name = f"staleness {eta if eta else '0 (sync)'} / {correction}"
            cells.append(Cell(name, [*mode, f"trainer.correction={{type: {correction}}}"]))
    run_grid(cells, args.seeds, root, common)
    title = f"default task, {args.steps} steps, {len(args.seeds)} seeds"
    print(table(cells, title))
    picture = plot(cells, root / "staleness.png", title)
    print(f"\nplot: {picture}\nruns: {root}")


if __name__ == "__main__":
    main()
