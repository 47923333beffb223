"""Image scorers: what an image domain pays, read from the image itself (no torch).

An item's image (`ScoreInput.image`) is a float32 or float64 [C, H, W] array in [-1, 1]
as the wire's msgpack array map; `image_of` reads it and says what is wrong with one that
is missing, malformed, not finite or outside that range (the item's error, with that
reason). The domains:

- `digit`: the digits judge's probability that the image is the digit in `reference`
  (0-9), or with `metadata.pay: correct` 1 when the judge's first choice is that digit
  and 0 otherwise (nothing more to gain from a digit the judge already reads right, so
  less to win by exaggerating one); components `probability` and `correct` either way.
  The judge (`rollwire.diffusion.judge`) is fitted once per machine into the cache and
  read once per scorer process (fitting it needs scikit-learn: `rollwire[diffusion]`).
  Reward feedback learning uses the same judge's weights in torch
  (`rollwire.diffusion.differentiable`).
- `brightness`: the mean pixel mapped from [-1, 1] to [0, 1].
- `contrast`: the pixels' standard deviation over its largest possible value, 1.
- `colour`: 1 minus the distance of the image's mean colour (one value per channel) to
  `metadata.target` (a list of C numbers in [-1, 1]), over the largest such distance.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rollwire.reward.scorers import Score, ScoreInput

MAX_IMAGE_VALUES = 4096 * 4096 * 4
"""The most values an image may hold."""
_JUDGE: list[Any] = []


def image_of(item: ScoreInput) -> np.ndarray:
    """The item's image as float64 [C, H, W]; ValueError saying what is wrong with it."""
    from rollwire.services.core.wire import WireError, array_from_bytes

    if not item.image:
        raise ValueError("this domain scores images: the item has none (ScoreItem.image)")
    try:
        array = array_from_bytes(item.image, "image")
    except WireError as error:
        raise ValueError(f"the image is not a wire array map: {error}") from None
    if array.dtype not in (np.float32, np.float64):
        raise ValueError(f"the image must be float32 or float64, not {array.dtype}")
    if array.ndim != 3 or min(array.shape) < 1 or array.size > MAX_IMAGE_VALUES:
        raise ValueError(f"the image must be [C, H, W] with C, H, W >= 1, not {list(array.shape)}")
    if not np.isfinite(array).all():
        raise ValueError("the image has values that are not finite")
    if array.min() < -1.0 - 1e-6 or array.max() > 1.0 + 1e-6:
        raise ValueError(
            f"the image's values lie in [{array.min():.3g}, {array.max():.3g}], not [-1, 1]"
        )
    return array.astype(np.float64)


def _judge() -> Any:
    if not _JUDGE:
        from rollwire.diffusion.judge import digits_judge

        try:
            _JUDGE.append(digits_judge())
        except ModuleNotFoundError as error:
            raise ValueError(
                f"the digit domain's judge is fitted on scikit-learn's digits ({error}): "
                "install rollwire[diffusion] beside this reward-server"
            ) from None
    return _JUDGE[0]


def digit_score(item: ScoreInput) -> Score:
    image = image_of(item)
    if image.shape != (1, 8, 8):
        raise ValueError(f"the digit domain scores 1x8x8 images, not {list(image.shape)}")
    reference = item.reference.strip()
    if len(reference) != 1 or not reference.isdigit():
        raise ValueError(f"the digit domain needs a reference digit 0-9, got {item.reference!r}")
    probabilities = _judge().probabilities(image[None])[0]
    wanted = int(reference)
    probability = float(probabilities[wanted])
    correct = float(int(probabilities.argmax()) == wanted)
    pay = item.metadata.get("pay", "probability")
    if pay not in ("probability", "correct"):
        raise ValueError(f"the digit domain pays `probability` or `correct`, not {pay!r}")
    reward = probability if pay == "probability" else correct
    return Score(reward, {"probability": probability, "correct": correct})


def brightness_score(item: ScoreInput) -> Score:
    brightness = float((image_of(item).mean() + 1.0) / 2.0)
    return Score(brightness, {"brightness": brightness})


def contrast_score(item: ScoreInput) -> Score:
    contrast = float(min(image_of(item).std(), 1.0))
    return Score(contrast, {"contrast": contrast})


def colour_score(item: ScoreInput) -> Score:
    image = image_of(item)
    target = item.metadata.get("target")
    if (
        not isinstance(target, list)
        or len(target) != image.shape[0]
        or not all(isinstance(v, (int, float)) and -1 <= v <= 1 for v in target)
    ):
        raise ValueError(
            f"the colour domain needs metadata.target: {image.shape[0]} numbers in [-1, 1], "
            f"one per channel, got {target!r}"
        )
    mean = image.mean(axis=(1, 2))
    distance = float(np.linalg.norm(mean - np.asarray(target, dtype=np.float64)))
    closeness = 1.0 - distance / (2.0 * math.sqrt(image.shape[0]))
    return Score(closeness, {"closeness": closeness, "distance": distance})


IMAGE_SCORERS = {
    "digit": ("digit_score", digit_score),
    "brightness": ("brightness_score", brightness_score),
    "contrast": ("contrast_score", contrast_score),
    "colour": ("colour_score", colour_score),
}
"""domain -> (scorer name, scorer), as `rollwire.reward.scorers.SCORERS`."""
