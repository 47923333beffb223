"""The `train` and `up` commands: the run folder, resuming, following a run, its summary.

rollwire train                 # the built-in default: tiny model, chain_sum, CPU
rollwire train -c run.yaml     # any configuration
rollwire up -c run.yaml        # the servers only, until Ctrl-C

This module decides what a run is (its folder and resolved config, whether it
resumes a checkpoint, when it is done, the reward plot at the end); starting and
supervising the processes is `launcher.py`'s job.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from rollwire.services.app.launcher import (
    LaunchError,
    Stack,
    prepare_model,
    start_servers,
    thread_budget,
)
from rollwire.services.app.liveness import Liveness, Target
from rollwire.services.app.scaler import Scaler
from rollwire.services.core.config import RunConfig, scored_domains, write_resolved_config
from rollwire.services.core.files import latest_checkpoint, read_jsonl, staged_directory
from rollwire.services.core.sandbox import INSTALL_HINT, bwrap_path
from rollwire.trainer.pipelines.table import SAMPLING_SERVICES, pipeline_of

log = logging.getLogger(__name__)


def stop_on_sigterm() -> None:
    """SIGTERM stops a run the way Ctrl-C does: every service is stopped, nothing is orphaned."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def check_sandbox(config: RunConfig) -> None:
    """A run that scores code on its own reward-server needs the sandbox: refused before
    anything starts, with the fix, rather than every item failing later."""
    orchestrator = config.orchestrator
    domains = scored_domains(orchestrator.dataset) | scored_domains(orchestrator.eval_dataset)
    if (
        "code" in domains
        and "code" not in config.reward_server.custom_scorers
        and not config.endpoints.reward_servers
        and config.reward_server.sandbox.kind == "bwrap"
        and bwrap_path() is None
    ):
        raise LaunchError(f"this run scores code (domain `code`), but {INSTALL_HINT}")


def _prepare(config: RunConfig) -> tuple[RunConfig, Path]:
    check_sandbox(config)
    if config.run.ray is not None:
        from rollwire.services.app.ray_cluster import check_reachable

        check_reachable(config.run.ray.address)
    run_dir = Path(config.run.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = latest_checkpoint(run_dir) if config.trainer.checkpointing.resume else None
    if checkpoint is None:
        for stale in ("trainer.jsonl", "eval.jsonl", "orchestrator.jsonl", QUALITY_RESULT):
            (run_dir / "metrics" / stale).unlink(missing_ok=True)
    if not config.trainer.checkpointing.resume:
        _forget_the_run_before(config, run_dir)
    print(f"run directory: {run_dir}")
    if checkpoint is not None:
        print(
            f"resuming from {checkpoint} (trainer.checkpointing.resume: false, or another run.output_dir, "
            "starts afresh)"
        )
    model = prepare_model(config)
    print(f"model: {model}")
    # A resumed run's rollout-servers start from the base model, which the checkpoint
    # has left behind: they hold requests until the trainer sends the checkpoint's
    # weights, or episodes sampled from the base model would be dropped as stale.
    rollout_server = {"model_path": model, **({"await_weights": True} if checkpoint else {})}
    trainer: dict[str, Any] = {"model_path": model}
    if config.run.cpu_threads:
        from rollwire.trainer.process.thread_plan import ThreadPlan

        # The trainer and the rollout-server start with the plan's threads; in async
        # mode the trainer moves them between the two as the run goes.
        servers = config.run.local_rollout_servers
        plan = ThreadPlan.start(config.run.cpu_threads, config.rl.mode == "sync", servers)
        rollout_server["threads"], trainer["threads"] = plan.per_server(servers), plan.trainer
        print(
            f"threads: {plan.total} shared ({config.rl.mode} mode): {plan.describe()}"
            + ("" if plan.sync else ", moved as the run goes")
        )
    buffer = config.buffer
    if buffer.trainer_token_file is None:
        buffer = buffer.model_copy(update={"trainer_token_file": _trainer_token(run_dir)})
    config = config.model_copy(
        update={
            "run": config.run.model_copy(update={"output_dir": run_dir}),
            "rollout_server": config.rollout_server.model_copy(update=rollout_server),
            "trainer": config.trainer.model_copy(update=trainer),
            "buffer": buffer,
        }
    )
    return config, run_dir


def _trainer_token(run_dir: Path) -> Path:
    """A fresh secret for the buffer's trainer socket (`buffer.trainer_token_file`), in a
    file only this user can read; the buffer and the trainer read it, no one else has it."""
    import secrets

    path = run_dir / "secrets" / "buffer-trainer.token"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_urlsafe(32) + "\n")
    return path


def _forget_the_run_before(config: RunConfig, run_dir: Path) -> None:
    """`trainer.checkpointing.resume: false` starts afresh: the buffer's log and the record of trained
    ids of a run before in this folder go too. Kept, the buffer would come back holding
    that run's ledger, and the orchestrator would take its prompts as done and wait with
    a trainer that starts again from step 0."""
    import shutil

    log_dir = config.buffer.data_dir or run_dir / "buffer"
    trained = run_dir / "metrics" / "trained_ids.jsonl"
    if not (Path(log_dir).exists() or trained.exists()):
        return
    shutil.rmtree(log_dir, ignore_errors=True)
    trained.unlink(missing_ok=True)
    print(
        f"trainer.checkpointing.resume is false: the buffer's log ({log_dir}) of the run before is removed"
    )


PREPARED_FROM = ".rollwire-prepared-from"
"""In a folder `rollwire prepare` wrote: the model folder it was copied from."""


def run_prepare(config: RunConfig, out: Path) -> int:
    """`rollwire prepare --out DIR`: the run's model (the configured one, or the built-in
    tiny one and its warm-up, as `rollwire train` makes it) copied into DIR, for services
    that do not share this machine's cache: a compose stack's volume, a cluster's shared
    disk. Done again only when the model it comes from changed."""
    import shutil

    try:
        model = prepare_model(config).resolve()
    except (LaunchError, ValueError, OSError) as error:
        print(f"rollwire prepare: {error}")
        return 1
    out = out.resolve()
    marker = out / PREPARED_FROM
    if (out / "config.json").exists() and marker.exists() and marker.read_text() == str(model):
        print(f"model: {out} (already prepared from {model})")
        return 0
    if model == out:
        print(f"model: {out}")
        return 0
    with staged_directory(out) as staging:
        shutil.copytree(model, staging, dirs_exist_ok=True)
        (staging / PREPARED_FROM).write_text(str(model))
    print(f"model: {out} (prepared from {model})")
    return 0


def run_up(config: RunConfig) -> int:
    """Starts the servers of a run and keeps them up until Ctrl-C."""
    stop_on_sigterm()
    try:
        config, run_dir = _prepare(config)
        stack = _stack(config, run_dir)
    except (LaunchError, ValueError, OSError) as error:
        print(f"rollwire up: {error}")
        return 1
    try:
        config = start_servers(config, stack)
        scaler = Scaler(stack, config, run_dir)
        config = scaler.with_members_file(config)
        path = write_resolved_config(config, run_dir)
        print(json.dumps(config.endpoints.model_dump(mode="json"), indent=2))
        print(
            f"resolved config with these endpoints: {path}\n"
            f"`rollwire scale {run_dir} rollout-server=+1` adds a server; Ctrl-C stops everything."
        )
        while True:
            stack.check()
            for line in scaler.poll():
                print(line)
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    except LaunchError as error:
        print(f"rollwire up: {error}")
        return 1
    finally:
        stack.stop()


def _stack(config: RunConfig, run_dir: Path) -> Stack:
    """The run's processes: local ones, or on a Ray cluster with `run.ray`."""
    from rollwire.services.app.ray_cluster import spawner_for

    threads = thread_budget(config)
    spawner = spawner_for(config, run_dir, threads)
    return Stack(run_dir, write_resolved_config(config, run_dir), threads, spawner)


def run_train(config: RunConfig) -> int:
    """Runs training end to end; returns the exit code."""
    stop_on_sigterm()
    started = time.perf_counter()
    try:
        config, run_dir = _prepare(config)
        stack = _stack(config, run_dir)
    except (LaunchError, ValueError, OSError) as error:
        print(f"rollwire train: {error}")
        return 1
    interrupted = False
    try:
        services = pipeline_of(config).services  # the pipeline table's entry of this run
        config = start_servers(config, stack, services=services)
        scaler = Scaler(stack, config, run_dir)
        config = scaler.with_members_file(config)
        write_resolved_config(config, run_dir)
        for name in ("trainer", "orchestrator"):  # the processes that train, once served
            if name in services:
                stack.start(name, ready=False)
        _follow(config, stack, run_dir, scaler)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping every service")
    except LaunchError as error:
        print(f"\nrollwire train: {error}")
        return 1
    finally:
        stack.stop()
    summary = summarise(run_dir, time.perf_counter() - started)
    print(summary)
    return 130 if interrupted else 0


def _follow(config: RunConfig, stack: Stack, run_dir: Path, scaler: Scaler) -> None:
    """Shows progress until the trainer finishes and the orchestrator's final evaluation is in."""
    from tqdm import tqdm

    total = config.rl.max_steps
    bar = tqdm(total=total, desc="training", unit="step", dynamic_ncols=True)
    trainer = next(s for s in stack.services if s.name == "trainer")
    orchestrator = next(s for s in stack.services if s.name == "orchestrator")
    liveness = Liveness(
        lambda: [
            Target(s.name, s.replica_of or s.name, s.address)
            for s in stack.services
            if s.address is not None and s.process.poll() is None
        ],
        say=bar.write,
        client=config.client,
    ).start()
    shown = judged = 0
    try:
        while True:
            stack.check(expected_to_finish=("trainer", "orchestrator"))
            for line in scaler.poll():
                bar.write(line)
            rows = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
            evals = read_jsonl(run_dir / "metrics" / "eval.jsonl")
            if rows and rows[-1]["step"] > shown:
                last = rows[-1]
                bar.update(last["step"] - shown)
                shown = last["step"]
                postfix = {
                    "reward": f"{last['reward_mean']:.2f}",
                    "staleness": f"{last.get('staleness_mean', 0):.1f}",
                    "traj/s": f"{last['trajectories_per_second']:.1f}",
                }
                if evals:
                    postfix["eval"] = f"{evals[-1]['eval_reward']:.2f}"
                bar.set_postfix(postfix)
            if trainer.process.poll() == 0 and orchestrator.process.poll() is not None:
                return
            if len(evals) > judged:  # a new evaluation: early stopping on its quality
                judged = len(evals)
                if _quality_left_the_band(config, run_dir, evals, rows, say=bar.write):
                    return
            if trainer.process.poll() == 0 and evals and evals[-1]["policy_version"] >= total:
                return
            time.sleep(0.5)
    finally:
        liveness.stop()
        bar.close()


QUALITY_RESULT = "quality_band.json"
"""metrics/ file of an image run with orchestrator.images.quality_band: its result."""


def _quality_left_the_band(
    config: RunConfig,
    run_dir: Path,
    evals: list[dict[str, Any]],
    steps: list[dict[str, Any]],
    say: Any = print,
) -> bool:
    """Early stopping on sample quality (orchestrator.images.quality_band): writes what
    the run keeps (the last evaluation inside the band, with the checkpoint of the step
    that made its version, by the trainer's rows `steps`) to metrics/quality_band.json,
    and True once the last `quality_patience` evaluations all left the band."""
    images = config.orchestrator.images
    if images.quality_band is None or not evals:
        return False
    from rollwire.rollout.orchestrator.images import quality_stop

    stop, kept = quality_stop(evals, images.quality_band, images.quality_patience)
    result: dict[str, Any] = {"band": images.quality_band, "stopped_at": None, "kept": None}
    if kept is not None:
        version = kept["policy_version"]
        # Versions equal steps until a trainer restart moves them ahead (ARCHITECTURE.md,
        # invariant 6): the trainer's rows say which step made the version.
        step = next((r["step"] for r in steps if r.get("policy_version") == version), version)
        folder = run_dir / "checkpoints" / f"step_{int(step):06d}"
        result["kept"] = {**kept, "checkpoint": str(folder) if version else None}
    if stop:
        result["stopped_at"] = evals[-1]["policy_version"]
        last = evals[-1]
        say(
            f"sample quality left the band at version {last['policy_version']} (Frechet "
            f"x{last['frechet_ratio']:.2f}, diversity x{last['diversity_ratio']:.2f}; band "
            f"{images.quality_band:g}): stopping the run"
        )
    (run_dir / "metrics" / QUALITY_RESULT).write_text(json.dumps(result, indent=1) + "\n")
    return stop


def quality_line(result: dict[str, Any]) -> str:
    """The summary's line on early stopping (metrics/quality_band.json)."""
    stopped = result["stopped_at"]
    head = (
        f"stopped early at version {stopped}: sample quality left the band ({result['band']:g})"
        if stopped is not None
        else f"sample quality band {result['band']:g}"
    )
    kept = result["kept"]
    if kept is None:
        return f"{head}; no evaluation was inside it"
    where = kept["checkpoint"] or "the starting model"
    return (
        f"{head}; the last evaluation inside it: version {kept['policy_version']}, held-out "
        f"reward {kept['eval_reward']:.3f}, Frechet x{kept['frechet_ratio']:.2f}, diversity "
        f"x{kept['diversity_ratio']:.2f} ({where})"
    )


def summarise(run_dir: Path, seconds: float) -> str:
    """Writes the reward-curve plot and returns a short report of the run."""
    rows = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    evals = read_jsonl(run_dir / "metrics" / "eval.jsonl")
    lines = [f"wall time {seconds:.0f}s, {len(rows)} steps"]
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(
            f"held-out eval reward: {first['eval_reward']:.3f} (version {first['policy_version']}) -> "
            f"{last['eval_reward']:.3f} (version {last['policy_version']})"
        )
        if "frechet_ratio" in last:  # an image run: what the samples became
            lines.append(
                f"sample quality at version {last['policy_version']}: Frechet distance "
                f"{last['frechet']:.2f} ({last['frechet_ratio']:.2f} x the start), diversity "
                f"{last['diversity']:.2f} ({last['diversity_ratio']:.2f} x the start); "
                f"curves: {run_dir / 'metrics' / 'image_quality.png'}"
            )
        quality = run_dir / "metrics" / QUALITY_RESULT
        if quality.exists():
            lines.append(quality_line(json.loads(quality.read_text())))
    if rows:
        lines.append(
            f"trainer idle fraction {rows[-1]['trainer_idle_fraction']:.2f}, "
            f"{rows[-1]['trajectories_per_second']:.1f} trajectories/s"
        )
    lines.extend(time_breakdown(rows, read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")))
    transport = weight_transport_used(rows)
    if transport:
        lines.append(transport)
    plot = plot_rewards(run_dir, rows, evals)
    if plot is not None:
        lines.append(f"reward curve: {plot}")
    lines.append(
        f"metrics: {run_dir / 'metrics'}, logs: {run_dir / 'logs'}, checkpoints: {run_dir / 'checkpoints'}"
    )
    return "\n".join(lines)


def weight_transport_used(steps: list[dict]) -> str:
    """How each step's weights reached the rollout-servers (`weights_by_group` in the
    trainer's metrics), said so that a group that never formed, or broke, is seen."""
    by_group = [row["weights_by_group"] for row in steps if "weights_by_group" in row]
    if not by_group:
        return ""
    grouped = sum(1 for value in by_group if value)
    if grouped == len(by_group):
        return f"weights went to the rollout-servers by broadcast in the weight group ({grouped} steps)"
    if grouped == 0:
        line = f"weights went to the rollout-servers as gRPC streams ({len(by_group)} steps)"
        sent = sum(row.get("publish_bytes", 0.0) for row in steps)
        whole = sum(row.get("publish_bytes_whole", 0.0) for row in steps)
        if whole:  # deltas or adapters: what travelled against whole updates
            line += f", {sent / 1e6:.1f} MB of {whole / 1e6:.1f} MB whole ({sent / whole:.0%})"
        return line
    return (
        f"weights went by the weight group for {grouped} of {len(by_group)} steps, then as gRPC "
        "streams: the group failed (the trainer's log says why)"
    )


TRAINER_PHASES = (
    *("wait", "proximal", "forward_backward", "optimizer", "critic", "gather"),
    *("publish", "ack", "checkpoint"),
)
"""The phases of a trainer step, in order (`time_<phase>_seconds` in its metrics)."""


def time_breakdown(steps: list[dict], progress: list[dict]) -> list[str]:
    """Where the time went: the trainer's mean step by phase (with what it left out as
    "other") and the orchestrator's calls per group, each with the CPU it used."""
    lines = []
    timed = [row for row in steps if "wall_seconds" in row]
    if timed:
        wall = sum(row["wall_seconds"] for row in timed) / len(timed)
        parts = []
        accounted = 0.0
        for phase in TRAINER_PHASES:
            seconds = sum(row.get(f"time_{phase}_seconds", 0.0) for row in timed) / len(timed)
            if seconds >= 0.0005:
                accounted += seconds
                parts.append(f"{phase.replace('_', '/')} {seconds:.3f} ({seconds / wall:.0%})")
        parts.append(f"other {max(wall - accounted, 0.0):.3f}")
        cores = sum(row["cpu_cores"] for row in timed) / len(timed)
        lines.append(
            f"trainer step, mean of {len(timed)}: {wall:.3f}s = "
            + ", ".join(parts)
            + f"; CPU {cores:.2f} cores"
        )
    last = progress[-1] if progress else {}
    groups = last.get("groups_completed", 0) + last.get("groups_failed", 0)
    if "wall_seconds" in last and groups:
        calls = [
            ("generate", "generate"),
            ("rollout_queue", "of it queued on the rollout-server"),
            ("score", "score"),
            ("score_tokens", "teacher scores"),
            ("buffer_put", "buffer put"),
        ]
        parts = [
            f"{label} {last[f'time_{key}_seconds'] / groups:.3f}"
            for key, label in calls
            if f"time_{key}_seconds" in last
        ]
        lines.append(
            f"orchestrator, seconds per group ({groups} groups, calls overlap): "
            + ", ".join(parts)
            + f"; CPU {last['cpu_cores']:.2f} cores"
        )
    return lines


def plot_rewards(run_dir: Path, rows: list[dict], evals: list[dict]) -> Path | None:
    if not rows and not evals:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    if rows:
        steps, rewards = [r["step"] for r in rows], [r["reward_mean"] for r in rows]
        # Each step's reward is a mean over one batch (noisy): the line to read is the
        # running mean, the steps stay faint behind it.
        window = max(1, min(10, len(rows) // 5))
        if window == 1:
            axis.plot(
                steps, rewards, color="tab:blue", alpha=0.6, label="training reward (sampled)"
            )
        else:
            running = [
                sum(rewards[max(0, i - window + 1) : i + 1]) / min(i + 1, window)
                for i in range(len(rewards))
            ]
            axis.plot(steps, rewards, color="tab:blue", alpha=0.25)
            label = f"training reward (sampled, mean of {window} steps)"
            axis.plot(steps, running, color="tab:blue", label=label)
    if evals:
        axis.plot(
            [e["policy_version"] for e in evals],
            [e["eval_reward"] for e in evals],
            "o-",
            color="tab:orange",
            label="held-out eval (greedy)",
        )
    axis.set_xlabel("policy version (optimizer steps)")
    axis.set_ylabel("reward")
    axis.set_ylim(0, 1.05)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    path = run_dir / "reward_curve.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _checkpoint_folder(path: Path) -> Path:
    """A Hugging Face folder as it is; a run folder (or its checkpoints/) as its newest
    checkpoint."""
    if (path / "config.json").exists():
        return path
    for run_dir in (path, path.parent):
        found = latest_checkpoint(run_dir)
        if found is not None:
            return found
    raise LaunchError(f"{path} is neither a model folder (config.json) nor a run with checkpoints")


def run_offline(config: RunConfig, name: str) -> int:
    """The pipeline `name` of the pipeline table that runs alone (`rollwire sft`, `dpo`,
    `reward-model`) on trainer.model_path, or on the built-in tiny model as it is built
    (no warm-up: the pipeline is the training); one that trains another family than the
    causal LM (`ode-distill`) chooses its own default model."""
    from rollwire.trainer.pipelines.table import CAUSAL_LM, PIPELINES, load

    if PIPELINES[name].family != CAUSAL_LM:  # its program knows its own default model
        return load(PIPELINES[name].program)(config)
    model = config.trainer.model_path or config.rollout_server.model_path
    if model is None:
        bare = config.model_copy(update={"warmup": config.warmup.model_copy(update={"steps": 0})})
        model = prepare_model(bare, progress=False)
    config = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"model_path": model})}
    )
    return load(PIPELINES[name].program)(config)


def run_distill_generate(config: RunConfig) -> int:
    """`rollwire distill generate`: the teacher (a rollout-server started on
    distill.teacher_model_path, else the run's model) answers distill.prompts training prompts, the reward-server scores the
    answers, and the kept ones become `prompt`/`completion` rows for `rollwire sft`."""
    import asyncio

    from transformers import AutoTokenizer

    from rollwire.rollout.orchestrator.sampler import Sampler
    from rollwire.services.core.datasets import task_at, training_tasks
    from rollwire.services.core.tiny import quiet_transformers

    stop_on_sigterm()
    quiet_transformers()
    distill, settings = config.distill, config.orchestrator
    if settings.dataset.type == "env":
        print("rollwire distill generate: env datasets are not supported (episodes, not prompts)")
        return 1
    if distill.top_k and config.rollout_server.engine in ("openai", "sglang"):
        print(
            f"rollwire distill generate: distill.top_k needs a teacher engine that scores "
            f"given tokens (hf or vllm); rollout_server.engine is "
            f"{config.rollout_server.engine}: set distill.top_k to 0 for sequence-level rows"
        )
        return 1
    try:
        teacher = distill.teacher_model_path or prepare_model(config)
        if not (Path(teacher) / "config.json").exists():
            raise LaunchError(f"distill.teacher_model_path {teacher} is not a Hugging Face folder")
    except (LaunchError, OSError) as error:
        print(f"rollwire distill generate: {error}")
        return 1
    work_dir = Path(config.run.output_dir).resolve()
    output = distill.output or work_dir / "distill.jsonl"
    print(f"teacher: {teacher}\nlogs: {work_dir / 'distill-logs'}")
    config = config.model_copy(
        update={
            "run": config.run.model_copy(update={"output_dir": work_dir / "distill-logs"}),
            "rollout_server": config.rollout_server.model_copy(update={"model_path": teacher}),
        }
    )
    stack = Stack(
        work_dir / "distill-logs",
        write_resolved_config(config, work_dir / "distill-logs"),
        thread_budget(config),
    )
    try:
        config = start_servers(config, stack, services=SAMPLING_SERVICES)
        tokenizer = AutoTokenizer.from_pretrained(teacher)
        pool = training_tasks(settings.dataset, settings.eval_dataset, config.run.seed)
        tasks = [task_at(pool, ordinal) for ordinal in range(distill.prompts)]

        async def generate() -> tuple[list[dict], dict[str, float]]:
            sampler = Sampler(config, tokenizer)
            try:
                return await sampler.teacher_rows(
                    tasks, distill.samples, distill.min_reward, distill.top_k
                )
            finally:
                await sampler.close()

        started = time.perf_counter()
        rows, counts = asyncio.run(generate())
    except (LaunchError, ValueError) as error:
        print(f"rollwire distill generate: {error}")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        stack.stop()
    if distill.top_k:
        from rollwire.services.core.tokenizer import tokenizer_digest

        # Token ids mean something only under this tokenizer: `rollwire sft` checks it.
        digest = tokenizer_digest(teacher)
        for row in rows:
            row["tokenizer"] = digest
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    print(
        f"{int(counts['answers'])} answers to {len(tasks)} prompts in "
        f"{time.perf_counter() - started:.1f} s, mean reward {counts['reward_mean']:.3f}; "
        f"{int(counts['kept'])} kept"
        + (f" (reward >= {distill.min_reward})" if distill.min_reward is not None else "")
        + f"\nwritten to {output}"
    )
    return 0


def run_eval(
    config: RunConfig, checkpoint: Path | None = None, samples: int = 0, correct_at: float = 1.0
) -> int:
    """`rollwire eval`: the held-out numbers of one model with the run's evaluation settings
    (eval set, prompt template, chat template, max_new_tokens, engine); prints them and
    writes them as JSON beside the logs of the services it started."""
    import asyncio

    from transformers import AutoTokenizer

    from rollwire.rollout.orchestrator.sampler import Sampler
    from rollwire.services.core.tiny import quiet_transformers

    stop_on_sigterm()
    quiet_transformers()
    try:
        if checkpoint is not None:
            model = _checkpoint_folder(Path(checkpoint)).resolve()
        else:
            model = prepare_model(config)
    except (LaunchError, OSError) as error:
        print(f"rollwire eval: {error}")
        return 1
    work_dir = Path(config.run.output_dir).resolve() / "evals" / model.name
    print(f"model: {model}\nlogs: {work_dir / 'logs'}")
    config = config.model_copy(
        update={
            "run": config.run.model_copy(update={"output_dir": work_dir}),
            "rollout_server": config.rollout_server.model_copy(update={"model_path": model}),
            "trainer": config.trainer.model_copy(update={"model_path": model}),
        }
    )
    stack = Stack(work_dir, write_resolved_config(config, work_dir), thread_budget(config))
    try:
        config = start_servers(config, stack, services=SAMPLING_SERVICES)
        tokenizer = AutoTokenizer.from_pretrained(model)

        async def measure() -> dict[str, float]:
            sampler = Sampler(config, tokenizer)
            try:
                return await sampler.measure(samples, correct_at)
            finally:
                await sampler.close()

        started = time.perf_counter()
        numbers = asyncio.run(measure())
    except (LaunchError, ValueError) as error:
        print(f"rollwire eval: {error}")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        stack.stop()
    numbers["seconds"] = time.perf_counter() - started
    result = {"model": str(model), "eval_dataset": config.orchestrator.eval_dataset, **numbers}
    (work_dir / "eval.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    for key, value in numbers.items():
        print(f"{key:>16}  {value:.4f}" if key != "tasks" else f"{key:>16}  {int(value)}")
    print(f"written to {work_dir / 'eval.json'}")
    return 0
