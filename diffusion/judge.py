"""The digits judge, without torch: a small classifier trained offline on the training
digits, and the sample-quality measures read in its hidden features.

`DigitsJudge` is a one-hidden-layer perceptron (64 -> 128 ReLU -> 10) fitted by
scikit-learn on `data.digits("train")` with a fixed seed and cached as an `.npz`; it is
used in numpy (the reward-server's image scorers, the evaluation's quality measures) and
in torch where a differentiable reward is wanted (reward feedback learning loads the same
weights). On the 297 held-out digits it is right on about 98% of them (`accuracy`).

Quality of a set of samples, in the judge's 128 hidden features:
- `frechet_distance(a, b)`: the Frechet distance between Gaussians fitted to two sets
  (as FID, in this small judge's features): 0 for identical statistics; a set of real
  training digits against the held-out ones reads about 1 on this scale, noise about 100.
- `diversity(features)`: the mean distance between two samples of a set; collapse to one
  image per class reads near 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollwire.diffusion.data import digits
from rollwire.services.core.files import building, cache_dir, staged_directory

HIDDEN = 128
SEED = 0
MARKER = "judge.json"


@dataclass(frozen=True)
class DigitsJudge:
    """The classifier's weights; see the module docstring."""

    w1: np.ndarray  # [64, HIDDEN]
    b1: np.ndarray  # [HIDDEN]
    w2: np.ndarray  # [HIDDEN, 10]
    b2: np.ndarray  # [10]

    @classmethod
    def load(cls, folder: Path) -> DigitsJudge:
        with np.load(Path(folder) / "weights.npz") as weights:
            return cls(*(weights[name].astype(np.float64) for name in ("w1", "b1", "w2", "b2")))

    def features(self, images: np.ndarray) -> np.ndarray:
        """[N, HIDDEN] hidden features of [N, 1, 8, 8] (or [N, 64]) images in [-1, 1]."""
        flat = np.asarray(images, dtype=np.float64).reshape(len(images), -1)
        if flat.shape[1] != 64:
            raise ValueError(f"expected 8x8 images, got {np.shape(images)}")
        return np.maximum(flat @ self.w1 + self.b1, 0.0)

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        """[N, 10] class probabilities."""
        logits = self.features(images) @ self.w2 + self.b2
        logits -= logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        return exp / exp.sum(axis=1, keepdims=True)

    def accuracy(self, images: np.ndarray, labels: np.ndarray) -> float:
        return float((self.probabilities(images).argmax(axis=1) == labels).mean())


def build_judge(folder: Path) -> Path:
    """Fits the judge (scikit-learn, fixed seed; about 4 s) and writes `weights.npz` and
    `judge.json`."""
    from sklearn.neural_network import MLPClassifier
    from threadpoolctl import threadpool_limits

    images, labels = digits("train")
    classifier = MLPClassifier(
        hidden_layer_sizes=(HIDDEN,), alpha=1e-3, max_iter=400, random_state=SEED, tol=1e-5
    )
    # One BLAS thread: small matrices, where more threads on a busy machine cost 10x.
    with threadpool_limits(1):
        classifier.fit(images.reshape(len(images), -1), labels)
    (w1, w2), (b1, b2) = classifier.coefs_, classifier.intercepts_
    judge = DigitsJudge(w1, b1, w2, b2)
    held_images, held_labels = digits("held_out")
    with staged_directory(folder, keep_if_present=MARKER) as staging:
        staging.mkdir()
        np.savez(staging / "weights.npz", w1=w1, b1=b1, w2=w2, b2=b2)
        info = {
            "hidden": HIDDEN,
            "seed": SEED,
            "held_out_accuracy": judge.accuracy(held_images, held_labels),
        }
        (staging / MARKER).write_text(json.dumps(info))
    return folder


def digits_judge() -> DigitsJudge:
    """The judge, fitted once into the cache (`$ROLLWIRE_CACHE_DIR/digits-judge`)."""
    folder = cache_dir() / f"digits-judge-{HIDDEN}-{SEED}"
    with building(folder, MARKER) as ready:
        if not ready:
            build_judge(folder)
    return DigitsJudge.load(folder)


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The Frechet distance between Gaussians fitted to the rows of `a` and of `b`."""
    mean_a, mean_b = a.mean(axis=0), b.mean(axis=0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    values, vectors = np.linalg.eigh(cov_a)
    root_a = (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T
    middle = root_a @ cov_b @ root_a
    cross = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0.0, None)).sum()
    distance = ((mean_a - mean_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2 * cross
    return float(max(distance, 0.0))


def diversity(features: np.ndarray) -> float:
    """The mean Euclidean distance between two different rows of `features`."""
    count = len(features)
    if count < 2:
        return 0.0
    squares = (features**2).sum(axis=1)
    gram = squares[:, None] + squares[None, :] - 2 * features @ features.T
    distances = np.sqrt(np.clip(gram, 0.0, None))
    return float(distances.sum() / (count * (count - 1)))
