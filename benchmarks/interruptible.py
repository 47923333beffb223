"""Interruptible generation on and off: the same asynchronous run, side by side.

    .venv/bin/python benchmarks/interruptible.py [-c CONFIG] [--set key=value ...]

Runs `rollwire train` in rl.mode=async twice, with rollout_server.interruptible
false (a weight update waits for the batch being generated to end, and the
trainer waits for the update) and true (the update lands between two decoding
steps; responses keep their tokens and carry two versions). Prints wall time,
trajectories/s, the trainer's idle fraction, mean publish time and the held-out
reward, and the ratio of the two. Extra `--set` options apply to both runs;
`--long TOKENS` runs long, uneven generations instead (no warm-up, reward =
response length; the tiny model's 256-token context bounds TOKENS).
Anchor: AReaL reports +12-17% throughput from interruptible generation.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from sync_vs_async import run  # benchmarks/sync_vs_async.py, beside this file

LENGTH_SCORER = """
from rollwire.reward.scorers import Score

def length(item):
    return Score(float(len(item.response)), {})
"""


def long_generations(folder: Path, tokens: int) -> list[str]:
    """Overrides for a run of long, uneven generations; the scorer module goes in `folder`,
    which joins PYTHONPATH (the services import it from there)."""
    (folder / "length_scorer.py").write_text(LENGTH_SCORER)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])
    prompts = folder / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"story {n}", "answer": ""}) + "\n" for n in range(512))
    )
    return [
        f"orchestrator.dataset={{type: file, path: {prompts}, domain: length}}",
        "orchestrator.eval_dataset=null",
        "orchestrator.prompt_template='{question}:'",
        "reward_server.custom_scorers={length: 'length_scorer:length'}",
        "warmup.steps=0",
        f"orchestrator.max_new_tokens={tokens}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", help="run configuration for both runs")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--long",
        type=int,
        metavar="TOKENS",
        help="long generations: no warm-up (the initial model rarely says EOS, so most "
        "responses run to TOKENS and a few stop early), reward = response length",
    )
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as temp:
        if args.long:
            args.overrides = [*long_generations(Path(temp), args.long), *args.overrides]
        for flag in ("false", "true"):
            root = Path(temp) / f"interruptible-{flag}"
            root.mkdir()
            overrides = [*args.overrides, f"rollout_server.interruptible={flag}"]
            rows[flag] = run("async", overrides, root, args.config)
            steps = [
                json.loads(line)
                for line in (root / "async" / "metrics" / "trainer.jsonl").read_text().splitlines()
            ]
            rows[flag]["publish_s"] = sum(s["time_publish_seconds"] for s in steps) / len(steps)
    keys = list(rows["false"])
    print(f"{'':>26} " + " ".join(f"{k:>14}" for k in keys))
    for flag, label in (("false", "waits for the batch"), ("true", "interruptible")):
        print(f"{label:>26} " + " ".join(f"{rows[flag][k]:>14.3f}" for k in keys))
    training = rows["true"]["training_seconds"] / rows["false"]["training_seconds"]
    rate = rows["true"]["trajectories_per_second"] / rows["false"]["trajectories_per_second"]
    print(
        f"\ninterruptible / waiting: training time {training:.2f}x, trajectories/s {rate:.2f}x "
        "(wall time also holds start-up, and the first run builds the warm-up model if the "
        "cache has none)"
    )


if __name__ == "__main__":
    main()
