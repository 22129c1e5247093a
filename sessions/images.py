"""A user item's image parts, checked when the item is created: a session's history is sent again with
every turn, so an image the thinker would refuse would fail each turn after it. The file's type and
size are read from its header (Pillow opens lazily: no pixel is decoded here)."""

from __future__ import annotations

import io

from services.base.errors import InvalidArgument

FORMATS = ("PNG", "JPEG")  # what the thinker decodes (omni.v1.Content.image)
MAX_PIXELS = 4096 * 4096  # the thinker's default --max-image-pixels (services/runtime/inputs/prompt.py)


def check_image(data: bytes, field: str, max_bytes: int) -> None:
    """InvalidArgument naming `field` for an image over `max_bytes`, not a png or jpeg, or over MAX_PIXELS."""
    if len(data) > max_bytes:
        raise InvalidArgument(field, f"the image is {len(data)} bytes, over the {max_bytes}-byte bound")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            kind, (width, height) = image.format, image.size
    except (UnidentifiedImageError, OSError, ValueError):
        kind, width, height = None, 0, 0
    if kind not in FORMATS:
        raise InvalidArgument(field, "not a png or jpeg file")
    if width * height > MAX_PIXELS:
        raise InvalidArgument(field, f"the image has {width * height} pixels ({width}x{height}), more than {MAX_PIXELS}")
