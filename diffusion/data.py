"""The built-in image task's data, without torch: scikit-learn's 8x8 handwritten digits.

1,797 images of 17 grey levels, scaled to [-1, 1] and split once by a fixed permutation
into 1,500 training images and 297 held-out ones (`HELD_OUT`): the held-out ones judge
samples (`judge.py`) and are never trained on. Labels 0-9 are the digits; `ANY` (10) is
the prompt "any digit", the model's unconditional branch.
"""

from __future__ import annotations

import numpy as np

ANY = 10
"""The label of the unconditional branch: any digit."""
LABELS = [*(str(digit) for digit in range(10)), "any"]
HELD_OUT = 297
"""Images of the fixed permutation kept out of training."""
IMAGE_SHAPE = (1, 8, 8)


def digits(split: str) -> tuple[np.ndarray, np.ndarray]:
    """`([N, 1, 8, 8] float32 images in [-1, 1], [N] int64 labels)` of the "train" (1,500)
    or "held_out" (297) split; the same arrays on every machine."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images.astype(np.float32) / 8.0 - 1.0)[:, None]
    labels = bunch.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    chosen = order[HELD_OUT:] if split == "train" else order[:HELD_OUT]
    return images[chosen], labels[chosen]


def label_of(prompt: str) -> int:
    """The class label of a prompt: "0"-"9", "a 3", "digit 3" name a digit; "any" or ""
    is `ANY`. ValueError for anything else."""
    words = prompt.strip().lower().replace("digit", " ").split()
    if not words or words == ["any"]:
        return ANY
    last = words[-1]
    if len(last) == 1 and last.isdigit():
        return int(last)
    raise ValueError(f"not a digits prompt: {prompt!r} (a digit 0-9, or 'any')")
