"""Grids of `rollwire train` runs for the algorithm benchmarks (staleness.py, algorithms.py):
one run per cell and seed, each in a fresh directory, summarised from its metrics; a
table of mean and spread over seeds, and a plot of held-out reward by policy version."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunResult:
    """One run's numbers."""

    wall_seconds: float
    evals: list[tuple[int, float]]
    """(policy version, held-out greedy reward), in order."""
    staleness_mean: float
    clipped: float
    """Mean over steps of the fraction of tokens clipped (low + high)."""
    masked_or_truncated: float
    """Mean over steps of the fraction of tokens the correction masked or truncated."""
    failed: str = ""

    @property
    def final(self) -> float:
        return self.evals[-1][1] if self.evals else float("nan")


def train(
    run_dir: Path, overrides: list[str], timeout: float = 1800, config: Path | None = None
) -> RunResult:
    """Runs `rollwire train [-c config] --set ...` into `run_dir` and reads its metrics back."""
    command = [sys.executable, "-m", "rollwire.services.app.cli", "train"]
    if config is not None:
        command += ["-c", str(config)]
    for item in (f"run.output_dir={run_dir}", *overrides):
        command += ["--set", item]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return RunResult(wall, [], float("nan"), 0.0, 0.0, failed=done.stdout[-1500:])

    def rows(name: str) -> list[dict]:
        path = run_dir / "metrics" / name
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    steps, evals = rows("trainer.jsonl"), rows("eval.jsonl")
    trained = [s for s in steps if s.get("optimizer_steps", 0) > 0] or [{}]
    return RunResult(
        wall,
        [(int(e["policy_version"]), float(e["eval_reward"])) for e in evals],
        statistics.fmean(s.get("staleness_mean", 0.0) for s in steps),
        statistics.fmean(
            s.get("clip_frac_high", 0.0) + s.get("clip_frac_low", 0.0) for s in trained
        ),
        statistics.fmean(
            s.get("is_truncated_frac", 0.0) + s.get("is_masked_frac", 0.0) for s in trained
        ),
    )


@dataclass
class Cell:
    """One setting of a grid and its runs over seeds."""

    name: str
    overrides: list[str]
    runs: list[RunResult] = field(default_factory=list)

    def spread(self, values: list[float]) -> str:
        if not values:
            return "n/a"
        mean = statistics.fmean(values)
        if len(values) == 1:
            return f"{mean:.3f}"
        return f"{mean:.3f} ± {statistics.stdev(values):.3f}"


def run_grid(
    cells: list[Cell],
    seeds: list[int],
    root: Path,
    common: list[str],
    config: Path | None = None,
) -> None:
    """Every cell with every seed (`orchestrator.sampling_seed`), one after another, on
    the default run or `config`'s."""
    total, count = len(cells) * len(seeds), 0
    for cell in cells:
        for seed in seeds:
            count += 1
            run_dir = root / cell.name.replace(" ", "_").replace("/", "-") / f"seed{seed}"
            overrides = [*common, *cell.overrides, f"orchestrator.sampling_seed={seed}"]
            result = train(run_dir, overrides, config=config)
            cell.runs.append(result)
            status = f"failed:\n{result.failed}" if result.failed else f"final {result.final:.3f}"
            print(
                f"[{count}/{total}] {cell.name} seed {seed}: {result.wall_seconds:.0f}s, {status}",
                flush=True,
            )


def table(cells: list[Cell], title: str) -> str:
    """Markdown: start and final held-out reward, best along the way, staleness, clip and
    correction fractions, wall time; mean ± standard deviation over seeds."""
    lines = [
        f"\n{title}\n",
        "| setting | runs | held-out start | held-out final | best | staleness | clipped | corrected | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        ok = [r for r in cell.runs if not r.failed]
        lines.append(
            f"| {cell.name} | {len(ok)}/{len(cell.runs)} | "
            f"{cell.spread([r.evals[0][1] for r in ok if r.evals])} | "
            f"{cell.spread([r.final for r in ok])} | "
            f"{cell.spread([max(v for _, v in r.evals) for r in ok if r.evals])} | "
            f"{cell.spread([r.staleness_mean for r in ok])} | "
            f"{cell.spread([r.clipped for r in ok])} | "
            f"{cell.spread([r.masked_or_truncated for r in ok])} | "
            f"{cell.spread([r.wall_seconds for r in ok])} |"
        )
    return "\n".join(lines)


def plot(cells: list[Cell], path: Path, title: str) -> Path | None:
    """Held-out reward by policy version, the mean over seeds of each cell."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(8, 5))
    styles = ("-", "--", ":", "-.")  # past ten cells the colours repeat; the styles tell them apart
    for index, cell in enumerate(cells):
        ok = [r for r in cell.runs if not r.failed and r.evals]
        if not ok:
            continue
        versions = sorted({v for r in ok for v, _ in r.evals})
        means = [
            statistics.fmean(dict(r.evals)[v] for r in ok if v in dict(r.evals)) for v in versions
        ]
        style = styles[index // 10 % len(styles)]
        axis.plot(versions, means, marker="o", linestyle=style, label=cell.name, alpha=0.8)
    axis.set_xlabel("policy version")
    axis.set_ylabel("held-out greedy reward (mean over seeds)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def parser(description: str) -> argparse.ArgumentParser:
    """The options every grid benchmark takes: steps, seeds, extra --set, output folder."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, help="folder for the runs and the plot")
    parser.add_argument(
        "-c", "--config", type=Path, help="the run to vary (default: the default run)"
    )
    return parser


def finish(cells: list[Cell], args: argparse.Namespace, root: Path, name: str) -> None:
    """Prints the table and writes the plot of a finished grid."""
    task = args.config.name if args.config else "default task"
    changed = f" with {', '.join(args.set)}" if args.set else ""
    title = f"{task}{changed}, {args.steps} steps, {len(args.seeds)} seeds"
    print(table(cells, title))
    picture = plot(cells, root / f"{name}.png", title)
    print(f"\nplot: {picture}\nruns: {root}")


def common_overrides(args: argparse.Namespace, *extra: str) -> list[str]:
    """Steps, four evaluations, no periodic checkpoints, then `extra` and the user's --set."""
    return [
        f"rl.max_steps={args.steps}",
        f"orchestrator.eval_every={max(1, args.steps // 4)}",
        "trainer.checkpointing.every=0",
        *extra,
        *args.set,
    ]


def output_root(args: argparse.Namespace, name: str) -> Path:
    return args.out or Path(tempfile.mkdtemp(prefix=f"rollwire-{name}-"))
