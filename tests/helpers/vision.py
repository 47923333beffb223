"""Images for the vision-language tests."""

from __future__ import annotations


def digit_images(count: int, first: int = 0) -> list:
    """`count` 8x8 digits of scikit-learn's set as PNG images by value, and their labels."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    from rollwire.services.core.images import encode_png

    digits = load_digits()
    return [
        (
            encode_png(Image.fromarray((digits.images[i] * 255 / 16).astype(np.uint8))),
            int(digits.target[i]),
        )
        for i in range(first, first + count)
    ]
