"""Images by value and by reference: every bad one is a clear ImageError (the services
turn it into INVALID_ARGUMENT), and trajectories carry them through the wire intact."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from rollwire.services.core.images import (
    ImageError,
    ImageLimits,
    ImageRef,
    encode_png,
    open_image,
)
from rollwire.services.core.wire import Trajectory, WireError, decode_trajectory, encode
from tests.helpers.trajectories import sequence


def _png(size: int = 8) -> ImageRef:
    return encode_png(Image.fromarray(np.arange(size * size, dtype=np.uint8).reshape(size, size)))


def test_an_image_opens_by_value_and_by_reference(tmp_path) -> None:
    image = _png()
    path = tmp_path / "digit.png"
    path.write_bytes(image.data)
    by_value = open_image(image, ImageLimits())
    for ref in (ImageRef.of_file(path), ImageRef(uri=f"file://{path}")):
        opened = open_image(ref, ImageLimits(roots=(str(tmp_path),)))
        assert opened.mode == "RGB" and np.array_equal(np.asarray(opened), np.asarray(by_value))


def test_every_bad_image_says_what_is_wrong(tmp_path) -> None:
    image = _png(64)
    jpeg = io.BytesIO()
    Image.new("RGB", (4, 4)).save(jpeg, format="JPEG")
    outside = tmp_path / "elsewhere" / "a.png"
    outside.parent.mkdir()
    outside.write_bytes(image.data)
    allowed = tmp_path / "images"
    allowed.mkdir()
    cases = [
        (ImageRef(data=b"\x89PNG not really", format="png"), ImageLimits(), "not an image"),
        (ImageRef(data=image.data[:60], format="png"), ImageLimits(), "does not decode"),
        (image, ImageLimits(max_bytes=100), "over image_inputs.max_bytes"),
        (image, ImageLimits(max_pixels=64 * 63), "64x64 pixels, over image_inputs.max_pixels"),
        (image, ImageLimits(formats=("jpeg",)), "is png; image_inputs.formats allows jpeg"),
        (ImageRef(data=jpeg.getvalue(), format="png"), ImageLimits(), "says it is png"),
        (ImageRef(uri=str(tmp_path / "missing.png")), ImageLimits(), "No such file"),
        (ImageRef(uri="https://example.com/a.png"), ImageLimits(), "never fetched"),
        (ImageRef(uri="s3://bucket/a.png"), ImageLimits(), "unknown scheme"),
        (ImageRef.of_file(outside), ImageLimits(roots=(str(allowed),)), "outside the folders"),
        (ImageRef.of_file(outside), ImageLimits(max_bytes=100), "over image_inputs.max_bytes"),
    ]
    for ref, limits, message in cases:
        with pytest.raises(ImageError, match=message.replace(".", r"\.")):
            open_image(ref, limits)
    with pytest.raises(ImageError, match="either by value"):
        ImageRef(data=b"x", uri="/a.png")
    with pytest.raises(ImageError, match="either by value"):
        ImageRef()


def _trajectory(images: list[ImageRef], tokens: int = 8) -> Trajectory:
    return sequence(list(range(tokens - 2)), [6, 7], images=images, reward=1.0)


def test_trajectories_carry_images_through_the_wire_and_refuse_broken_ones() -> None:
    value, reference = _png().with_offset(1), ImageRef(uri="/data/a.png", offset=4)
    trajectory = _trajectory([value, reference])
    assert decode_trajectory(encode(trajectory)) == trajectory
    # A text trajectory's frame has no images field at all.
    assert b"images" not in encode(_trajectory([]))
    for images, message in (
        ([ImageRef(uri="/a.png", offset=8)], "not inside the episode"),
        ([reference, value], "not inside the episode"),  # out of order
    ):
        with pytest.raises(WireError, match=message):
            decode_trajectory(encode(_trajectory(images)))


def test_image_datasets_show_images_and_keep_the_held_out_ones_apart(tmp_path) -> None:
    import base64
    import json

    from rollwire.services.core.config import DigitsDataset, FileDataset
    from rollwire.services.core.datasets import load_tasks, task_at, task_key, training_tasks

    train, held = load_tasks(DigitsDataset()), load_tasks(DigitsDataset(split="held_out"))
    assert (len(train), len(held)) == (1500, 297)
    first = train[0]
    assert first.reference == "0" and open_image(first.images[0], ImageLimits()).size == (8, 8)
    assert not {task_key(t) for t in train} & {task_key(t) for t in held}
    kept = training_tasks(DigitsDataset(), DigitsDataset(split="held_out"))
    assert len(kept) == 1500 and kept[7].images == train[7].images
    # A run's stream of prompts (a second epoch here) shows each task's images too.
    assert task_at(kept, 1507).images == train[7].images
    shuffled = load_tasks(DigitsDataset(seed=3))
    assert [t.reference for t in shuffled][:20] != [t.reference for t in train][:20]

    image = _png()
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(image.data)
    rows = [
        {"prompt": "What is shown?", "answer": "1", "images": ["pics/a.png"]},
        {
            "prompt": "What is shown?",
            "answer": "2",
            "images": [{"data": base64.b64encode(image.data).decode(), "format": "png"}],
        },
        {"prompt": "Text only", "answer": "3"},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tasks = load_tasks(FileDataset(path=path))
    assert tasks[0].images == (ImageRef(uri=str(tmp_path / "pics" / "a.png")),)
    assert tasks[1].images == (image,) and tasks[2].images == ()
    assert "images" not in tasks[0].metadata
    # One question about two different images: two tasks, not one.
    assert task_key(tasks[0]) != task_key(tasks[1])
    path.write_text(json.dumps({"prompt": "p", "answer": "1", "images": [3]}) + "\n")
    with pytest.raises(ValueError, match="row 0: an image is a path, a URI"):
        load_tasks(FileDataset(path=path))
