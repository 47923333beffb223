"""Images as prompts and observations carry them: by value or by reference, bounded.

An `ImageRef` is either the encoded bytes of an image with their format (`data`, `format`)
or a reference the services can read (`uri`: a path or `file://` URI on a volume they
share). Nothing is ever fetched from the network: an `http(s)://` reference is refused.
Every service that opens one (the rollout-server for its engine, the trainer for its
forward, the orchestrator for the placeholders) does it through `open_image`, under one
`ImageLimits` (`image_inputs` in the run's config), so a bad image is the same clear
`ImageError` wherever it is found: a format not allowed, bytes past the limit, pixels past
the limit, a file that is missing or outside the allowed folders, bytes that do not decode.

Images travel on the wire as plain mappings (`to_wire`, `of_wire`) and in protos as
`rollwire.v1.Image` (`to_proto`, `of_proto`); a trajectory also says where in its token
sequence each image sits (`offset`: the index of its first placeholder token).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

FORMATS = ("png", "jpeg", "webp", "gif", "bmp")
"""Formats an image may be given in (by Pillow's names, lower case; `jpg` means jpeg)."""


class ImageError(ValueError):
    """An image that cannot be used: the message says which limit or what is wrong."""


@dataclass(frozen=True)
class ImageLimits:
    """What an image may be (`image_inputs` in the run's config)."""

    max_bytes: int = 4 << 20
    """Largest encoded image, by value or as a file."""
    max_pixels: int = 4096 * 4096
    """Largest width x height once decoded (checked before the pixels are decoded)."""
    formats: tuple[str, ...] = FORMATS
    roots: tuple[str, ...] = ()
    """Folders a referenced image may lie in (empty: any local path)."""


@dataclass(frozen=True)
class ImageRef:
    """One image, by value (`data` and `format`) or by reference (`uri`); see the module."""

    data: bytes = b""
    format: str = ""
    uri: str = ""
    offset: int = -1
    """In a trajectory: the index of the image's first placeholder token (-1 elsewhere)."""

    def __post_init__(self) -> None:
        if bool(self.data) == bool(self.uri):
            raise ImageError("an image is given either by value (data) or by reference (uri)")

    @classmethod
    def of_file(cls, path: str | Path) -> ImageRef:
        return cls(uri=str(Path(path).resolve()))

    def with_offset(self, offset: int) -> ImageRef:
        return ImageRef(self.data, self.format, self.uri, offset)

    def describe(self) -> str:
        return self.uri or f"a {self.format or 'unnamed'} image of {len(self.data)} bytes"


def encode_png(image: Any) -> ImageRef:
    """A PIL image by value, as PNG."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return ImageRef(data=out.getvalue(), format="png")


def _path_of(uri: str, limits: ImageLimits) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https", "ftp"):
        raise ImageError(
            f"image {uri}: images are never fetched from the network; give the bytes, or a "
            "path on a volume the services share"
        )
    if parsed.scheme not in ("", "file"):
        raise ImageError(f"image {uri}: unknown scheme {parsed.scheme!r} (a path or file://)")
    path = Path(unquote(parsed.path) if parsed.scheme == "file" else uri).resolve()
    if limits.roots and not any(path.is_relative_to(Path(root).resolve()) for root in limits.roots):
        raise ImageError(
            f"image {uri} is outside the folders images may be read from "
            f"(image_inputs.roots: {', '.join(limits.roots)})"
        )
    return path


def read_bytes(ref: ImageRef, limits: ImageLimits) -> bytes:
    """The encoded bytes of `ref` (read from its file when referenced), within the limits."""
    if ref.data:
        data = ref.data
    else:
        path = _path_of(ref.uri, limits)
        try:
            size = path.stat().st_size
        except OSError as error:
            raise ImageError(f"image {ref.uri}: {error.strerror or error}") from None
        if size > limits.max_bytes:
            raise ImageError(
                f"image {ref.uri} is {size} bytes, over image_inputs.max_bytes ({limits.max_bytes})"
            )
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ImageError(f"image {ref.uri}: {error.strerror or error}") from None
    if len(data) > limits.max_bytes:
        raise ImageError(
            f"{ref.describe()} is over image_inputs.max_bytes ({limits.max_bytes} bytes)"
        )
    return data


def open_image(ref: ImageRef, limits: ImageLimits) -> Any:
    """`ref` decoded as an RGB PIL image; ImageError naming what is wrong otherwise."""
    from PIL import Image, UnidentifiedImageError

    data = read_bytes(ref, limits)
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageError(f"{ref.describe()} is not an image in any format Pillow reads") from None
    actual = (image.format or "").lower()
    stated = "jpeg" if ref.format.lower() == "jpg" else ref.format.lower()
    if actual not in limits.formats:
        raise ImageError(
            f"{ref.describe()} is {actual or 'of no known format'}; image_inputs.formats "
            f"allows {', '.join(limits.formats)}"
        )
    if stated and stated != actual:
        raise ImageError(f"{ref.describe()} says it is {stated} but its bytes are {actual}")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(
            f"{ref.describe()} is {width}x{height} pixels, over image_inputs.max_pixels "
            f"({limits.max_pixels})"
        )
    try:
        return image.convert("RGB")
    except (OSError, ValueError) as error:  # truncated bytes fail only when decoded
        raise ImageError(f"{ref.describe()} does not decode: {error}") from None


def images_of(value: Any, folder: Path, where: str) -> tuple[ImageRef, ...]:
    """A data row's `images` column: paths (relative ones from `folder`, the file's),
    URIs, or {data: <base64>, format} mappings; ValueError naming `where` otherwise."""
    import base64

    if not isinstance(value, list):
        raise ValueError(f"{where}: images must be a list")
    out = []
    for item in value:
        if isinstance(item, str):
            uri = item if "://" in item or Path(item).is_absolute() else str(folder / item)
            out.append(ImageRef(uri=uri))
        elif isinstance(item, dict) and "data" in item:
            out.append(ImageRef(data=base64.b64decode(item["data"]), format=item.get("format", "")))
        elif isinstance(item, dict) and "uri" in item:
            out.append(ImageRef(uri=str(item["uri"])))
        else:
            raise ValueError(f"{where}: an image is a path, a URI, or {{data, format}}")
    return tuple(out)


def row_value(ref: ImageRef) -> str | dict[str, str]:
    """An image as a data row's `images` column holds it (`images_of` reads it back): its
    uri, or {data: <base64>, format}."""
    import base64

    if ref.uri:
        return ref.uri
    return {"data": base64.b64encode(ref.data).decode("ascii"), "format": ref.format}


# ------------------------------------------------------------------ wire and proto


def to_wire(ref: ImageRef) -> dict[str, Any]:
    return {"data": ref.data, "format": ref.format, "uri": ref.uri, "offset": ref.offset}


def of_wire(value: Any) -> ImageRef:
    """An image from its wire mapping; ImageError for one that is not."""
    if not isinstance(value, Mapping):
        raise ImageError(f"an image must be a mapping, not {type(value).__name__}")
    unknown = set(value) - {"data", "format", "uri", "offset"}
    if unknown:
        raise ImageError(f"an image has unknown fields {sorted(unknown)}")
    data, fmt, uri, offset = (
        value.get("data", b""),
        value.get("format", ""),
        value.get("uri", ""),
        value.get("offset", -1),
    )
    if not isinstance(data, (bytes, bytearray)) or not isinstance(fmt, str):
        raise ImageError("an image's data must be bytes and its format a string")
    if not isinstance(uri, str) or not isinstance(offset, int) or isinstance(offset, bool):
        raise ImageError("an image's uri must be a string and its offset an integer")
    return ImageRef(bytes(data), fmt, uri, offset)


def to_proto(ref: ImageRef) -> Any:
    """The image as the wire's `rollwire.v1.Image` (env.proto; prompts use it too)."""
    from rollwire.proto.v1 import env_pb2

    return env_pb2.Image(data=ref.data, format=ref.format, uri=ref.uri)


def of_protos(messages: Iterable[Any]) -> list[ImageRef]:
    return [ImageRef(bytes(m.data), m.format, m.uri) for m in messages]
