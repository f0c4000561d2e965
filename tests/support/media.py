"""Images the tests send: seeded random pixels, encoded as files, or as data URIs (the REST routes)."""

from __future__ import annotations

import base64
import io

import numpy as np


def random_image(seed: int, size: tuple[int, int] = (64, 48)):
    """An RGB PIL image of `size` (width, height), its pixels drawn from `seed`."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def encoded(image, fmt: str = "PNG") -> bytes:
    """The image as a file of `fmt` (what a client sends)."""
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def png_data_uri(image) -> str:
    return "data:image/png;base64," + base64.b64encode(encoded(image)).decode()
