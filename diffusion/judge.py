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
- `class_matched_frechet(features, classes, real, real_classes)`: the Frechet distance of
  samples to real digits of the same classes in the same proportions (the classes the
  judge reads the samples as): whether the samples are good digits of what they are,
  comparable between a model that draws any digit and one that draws only 3s.
- `within_class_diversity(features, classes)`: `diversity` inside each judged class,
  averaged over the samples; a model that draws every digit is not "diverse" for it.
  `relative_diversity` divides it by the same measure of real digits of those classes:
  1 is as varied as real digits of what the samples are (some digits vary more than
  others: real 3s read 7.5, the mixture of all ten 8.5).
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
    return gaussian_frechet(
        a.mean(axis=0), np.cov(a, rowvar=False), b.mean(axis=0), np.cov(b, rowvar=False)
    )


def gaussian_frechet(
    mean_a: np.ndarray, cov_a: np.ndarray, mean_b: np.ndarray, cov_b: np.ndarray
) -> float:
    """The Frechet distance between two Gaussians."""
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


def class_matched_frechet(
    features: np.ndarray, classes: np.ndarray, real: np.ndarray, real_classes: np.ndarray
) -> float:
    """The Frechet distance of `features` to the Gaussian of the real features' mixture
    with the samples' class proportions: each class's mean and covariance among `real`,
    weighted by the share of `classes` that are that class (see the module docstring)."""
    classes, real_classes = np.asarray(classes), np.asarray(real_classes)
    present, counts = np.unique(classes, return_counts=True)
    weights = counts / counts.sum()
    means, covariances = [], []
    for label in present:
        rows = real[real_classes == label]
        if len(rows) < 2:
            raise ValueError(f"fewer than two real examples of class {label}")
        means.append(rows.mean(axis=0))
        covariances.append(np.cov(rows, rowvar=False))
    mean = sum(weight * class_mean for weight, class_mean in zip(weights, means, strict=True))
    # The mixture's covariance as within-class plus between-class spread: no large
    # second moment minus a large outer product, whose cancellation loses digits (and
    # one class gives that class's covariance exactly).
    covariance = sum(
        weight * (class_covariance + np.outer(class_mean - mean, class_mean - mean))
        for weight, class_mean, class_covariance in zip(weights, means, covariances, strict=True)
    )
    return gaussian_frechet(features.mean(axis=0), np.cov(features, rowvar=False), mean, covariance)


def within_class_diversity(
    features: np.ndarray, classes: np.ndarray, weights_from: np.ndarray | None = None
) -> float:
    """`diversity` inside each class of `classes` (those with two samples or more),
    averaged with each class weighted by its samples (or by its count in
    `weights_from`, a set of class labels)."""
    classes = np.asarray(classes)
    counted = classes if weights_from is None else np.asarray(weights_from)
    total, weight = 0.0, 0
    for label in np.unique(counted):
        rows = features[classes == label]
        count = int((counted == label).sum())
        if len(rows) >= 2 and (weights_from is not None or count >= 2):
            total += count * diversity(rows)
            weight += count
    return total / weight if weight else 0.0


def relative_diversity(
    features: np.ndarray, classes: np.ndarray, real: np.ndarray, real_classes: np.ndarray
) -> float:
    """`within_class_diversity` of the samples over that of the real digits of the same
    classes, weighted alike (see the module docstring)."""
    classes = np.asarray(classes)
    labels, counts = np.unique(classes, return_counts=True)
    kept = labels[counts >= 2]
    mask = np.isin(classes, kept)
    if not mask.any():
        return 0.0
    samples = within_class_diversity(features[mask], classes[mask])
    reference = within_class_diversity(real, real_classes, weights_from=classes[mask])
    return samples / reference


@dataclass
class SampleQuality:
    """The judge's measures of class-conditional samples against the real training digits:
    `accuracy` (the share it reads as the class asked for), `frechet` (`frechet_distance`
    of their features to the training digits'), `diversity` (`relative_diversity`: within
    the classes it reads them as, over real digits'). The held-out digits themselves read
    `floor()`: the distance of real digits the model never saw."""

    judge: DigitsJudge
    real: np.ndarray
    real_classes: np.ndarray

    @classmethod
    def load(cls) -> SampleQuality:
        judge = digits_judge()
        images, labels = digits("train")
        return cls(judge, judge.features(images), labels)

    def measure(self, images: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        features = self.judge.features(images)
        classes = self.judge.probabilities(images).argmax(axis=1)
        return {
            "accuracy": float((classes == np.asarray(labels)).mean()),
            "frechet": frechet_distance(features, self.real),
            "diversity": relative_diversity(features, classes, self.real, self.real_classes),
        }

    def floor(self) -> dict[str, float]:
        images, labels = digits("held_out")
        return self.measure(images, labels)
