"""A user item's image parts as the sessions service checks them when the item is created
(sessions/images.py): png and jpeg within the bounds taken, the rest refused naming the field."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from services.base.errors import InvalidArgument
from sessions.images import MAX_PIXELS, check_image


def image_file(size: tuple[int, int], fmt: str, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_png_or_jpeg_within_the_bounds_is_taken(fmt):
    check_image(image_file((64, 48), fmt), "f", 1 << 20)


@pytest.mark.parametrize(("data", "bound", "says"), [
    (image_file((64, 48), "GIF", "P"), 1 << 20, "not a png or jpeg"),
    (b"\x89PNG but not one", 1 << 20, "not a png or jpeg"),
    (image_file((64, 48), "PNG"), 50, "over the 50-byte bound"),
    (image_file((4097, 4097), "PNG", "1"), 1 << 20, f"more than {MAX_PIXELS}"),  # 1-bit: a small file, many pixels
], ids=["gif", "not-an-image", "over-the-bytes", "over-the-pixels"])
def test_an_image_we_would_refuse_at_every_turn_is_refused_now_naming_the_field(data, bound, says):
    with pytest.raises(InvalidArgument) as refused:
        check_image(data, "create_item.message.content[0].image", bound)
    assert refused.value.field == "create_item.message.content[0].image" and says in str(refused.value)
