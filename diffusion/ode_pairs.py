"""A teacher's ODE trajectories kept as a few-step student's training pairs, on disk.

A folder of pairs holds `fingerprint.json` (what made them: the teacher's weights digest,
its sampling settings, the kept nodes, the seed; `PairSettings`) and files
`pairs-NNNNNN.npz` of `per_file` trajectories each:

- `latents` [N, K, C, H, W]: the latent at each of the K kept grid indices (`nodes`);
- `clean` [N, C, H, W]: the trajectory's end, the teacher's sample;
- `labels` [N], `seeds` [N]: its class and its noise's seed.

Trajectory i is class `i % 10`, drawn from `pair_seed(settings.seed, i)`, so file n holds
the same trajectories whoever makes it, and a folder is filled in any order by any number
of workers: `missing_files` says which files are still to make, `write_file` writes one
whole or not at all, and a folder made with other settings is refused, not mixed.
Training seeds are 62-bit hashes of the seed and the index; evaluation seeds
(`EVAL_SEED_BASE` up) are never drawn for training but by a 1-in-2**22 chance each.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rollwire.diffusion.flow import time_grid

FINGERPRINT = "fingerprint.json"
CLASSES = 10
EVAL_SEED_BASE = 1 << 40
"""Evaluation noise seeds start here (training seeds spread over 62 bits)."""


@dataclass(frozen=True)
class PairSettings:
    """What makes a folder's pairs; two folders of equal settings hold equal pairs."""

    teacher: str
    """The teacher's weights digest (`teacher_digest`)."""
    steps: int
    guidance: float
    shift: float
    nodes: tuple[int, ...]
    seed: int
    per_file: int

    def times(self) -> list[float]:
        """The time of each kept node on the teacher's grid."""
        grid = time_grid(self.steps, self.shift)
        return [grid[node] for node in self.nodes]


def teacher_digest(folder: Path) -> str:
    """sha256 of a model folder's weights files (what the teacher computes with)."""
    digest = hashlib.sha256()
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def pair_seed(seed: int, index: int) -> int:
    """Trajectory `index`'s noise seed: 62 bits of a hash of the folder's seed and it."""
    value = hashlib.blake2b(f"ode/{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(value, "big") >> 2


def file_name(index: int) -> str:
    return f"pairs-{index:06d}.npz"


def prepare_folder(folder: Path, settings: PairSettings) -> None:
    """Makes `folder` for pairs of `settings`, or checks that the pairs it holds are
    theirs; ValueError naming what differs otherwise."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FINGERPRINT
    wanted = asdict(settings)
    wanted["nodes"] = list(settings.nodes)
    if not path.exists():
        temporary = folder / f".{FINGERPRINT}.{os.getpid()}"
        temporary.write_text(json.dumps(wanted, indent=1))
        os.replace(temporary, path)
        return
    held = json.loads(path.read_text())
    differ = sorted(key for key in wanted if held.get(key) != wanted[key])
    if differ:
        raise ValueError(
            f"{folder} holds pairs made with other settings ({', '.join(differ)} differ: "
            f"{ {k: held.get(k) for k in differ} } there, { {k: wanted[k] for k in differ} } "
            "now); point ode_distill.data at another folder or remove it"
        )


def files_for(count: int, per_file: int) -> int:
    return -(-count // per_file)


def missing_files(folder: Path, settings: PairSettings, count: int) -> list[int]:
    """The files of the first `count` trajectories not yet in `folder`, or holding fewer
    than `count` asks of them: the short last file of a run that made fewer, made again
    whole."""
    missing = []
    for index in range(files_for(count, settings.per_file)):
        path = Path(folder) / file_name(index)
        wanted = len(file_trajectories(index, settings, count))
        if not path.exists() or _held(path) < wanted:
            missing.append(index)
    return missing


def _held(path: Path) -> int:
    """The trajectories a pairs file holds (its labels' length, read alone)."""
    with np.load(path) as data:
        return len(data["labels"])


def file_trajectories(index: int, settings: PairSettings, count: int) -> range:
    """The trajectory indices file `index` holds (the last one may hold fewer)."""
    first = index * settings.per_file
    return range(first, min(first + settings.per_file, count))


def write_file(
    folder: Path,
    index: int,
    latents: np.ndarray,
    clean: np.ndarray,
    labels: np.ndarray,
    seeds: np.ndarray,
) -> Path:
    """Writes file `index` whole (a temporary file, then renamed)."""
    path = Path(folder) / file_name(index)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("wb") as out:
        np.savez(
            out,
            latents=latents.astype(np.float32),
            clean=clean.astype(np.float32),
            labels=labels.astype(np.int64),
            seeds=seeds.astype(np.int64),
        )
    os.replace(temporary, path)
    return path


@dataclass
class Pairs:
    """A folder's trajectories, in order."""

    latents: np.ndarray
    """[N, K, C, H, W]"""
    clean: np.ndarray
    """[N, C, H, W]"""
    labels: np.ndarray
    seeds: np.ndarray
    times: list[float]
    """[K] the nodes' times."""

    def __len__(self) -> int:
        return len(self.labels)


def load_pairs(folder: Path, count: int | None = None) -> Pairs:
    """The first `count` trajectories of a folder (all it holds when None); ValueError
    when files are missing."""
    folder = Path(folder)
    if not (folder / FINGERPRINT).exists():
        raise ValueError(f"{folder} holds no pairs (no {FINGERPRINT})")
    held = json.loads((folder / FINGERPRINT).read_text())
    settings = PairSettings(**{**held, "nodes": tuple(held["nodes"])})
    if count is None:
        count = len(sorted(folder.glob("pairs-*.npz"))) * settings.per_file
    parts = []
    for index in range(files_for(count, settings.per_file)):
        path = folder / file_name(index)
        if not path.exists():
            raise ValueError(f"{path} is missing: make the pairs first (rollwire ode-distill)")
        with np.load(path) as data:
            parts.append({key: data[key] for key in ("latents", "clean", "labels", "seeds")})
    joined = {key: np.concatenate([part[key] for part in parts])[:count] for key in parts[0]}
    return Pairs(times=settings.times(), **joined)
