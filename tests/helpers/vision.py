"""Images for the vision-language tests."""

from __future__ import annotations


def digit_images(count: int, first: int = 0) -> list:
    """`count` 8x8 digits of scikit-learn's set as PNG images by value, and their labels."""
    from rollwire.services.core.datasets import Digits

    digits = Digits.load()
    return [(digits.picture(i), digits.label(i)) for i in range(first, first + count)]
