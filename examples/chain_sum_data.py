"""Writes the data files of examples/sft.yaml and examples/dpo.yaml: the default task
(chain_sum sums) as rows a user would bring, none of them a question of the default
evaluation set. No download: reasoning-gym generates the questions.

    .venv/bin/python examples/chain_sum_data.py data/            # writes data/*.jsonl
    .venv/bin/rollwire sft -c examples/sft.yaml
    .venv/bin/rollwire dpo -c examples/dpo.yaml

`sft.jsonl`: chat `messages` rows, the answer off by one in 60% of them (a flawed
teacher, which leaves something for DPO and RL to fix); `pairs.jsonl`: preference
rows preferring the right answer to the one off by one.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def write(folder: Path, sft_rows: int = 4000, pairs: int = 3000, off_by_one: float = 0.6) -> None:
    from rollwire.services.core.config import RunConfig
    from rollwire.services.core.datasets import training_tasks

    config = RunConfig()
    template = config.orchestrator.prompt_template
    folder.mkdir(parents=True, exist_ok=True)
    for name, size, seed in (("sft.jsonl", sft_rows, 7), ("pairs.jsonl", pairs, 11)):
        dataset = config.orchestrator.dataset.model_copy(update={"seed": seed, "size": size})
        tasks = training_tasks(dataset, config.orchestrator.eval_dataset)
        rng = random.Random(seed)
        with (folder / name).open("w") as out:
            for task in tasks:
                prompt = task.prompt(template)
                right = f"<answer>{task.reference}</answer>"
                wrong = f"<answer>{int(task.reference) + 1}</answer>"
                if name == "pairs.jsonl":
                    row = {"prompt": prompt, "chosen": right, "rejected": wrong}
                else:
                    answer = wrong if rng.random() < off_by_one else right
                    row = {
                        "messages": [
                            {"role": "user", "content": prompt},
                            {"role": "assistant", "content": answer},
                        ]
                    }
                out.write(json.dumps(row) + "\n")
        print(
            f"{folder / name}: {len(tasks)} rows ({tasks.excluded} evaluation questions left out)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, nargs="?", default=Path("data"))
    parser.add_argument("--off-by-one", type=float, default=0.6)
    args = parser.parse_args()
    write(args.folder, off_by_one=args.off_by_one)


if __name__ == "__main__":
    main()
