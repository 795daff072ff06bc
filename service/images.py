"""Decode request images (PNG/JPEG bytes or nested pixel arrays) into the model's input spec."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from models.data import PreprocessSpec
from service.errors import BadImage

MAX_PIXELS = 4096 * 4096  # refuse decompression bombs before decoding them


def decode_bytes(data: bytes) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_PIXELS:
            raise BadImage(f"image of {img.width}x{img.height} pixels is over the limit of {MAX_PIXELS}")
        if img.format not in ("PNG", "JPEG"):
            raise BadImage(f"image format {img.format} is not accepted; send PNG or JPEG")
        img.load()
        return img
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise BadImage(f"cannot decode the image: {type(e).__name__}") from None


def decode_base64(text: str) -> Image.Image:
    if text.startswith("data:"):
        text = text.split(",", 1)[-1]
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadImage("image is not valid base64") from None
    return decode_bytes(data)


def decode_array(pixels: list[Any]) -> Image.Image:
    """Nested list of grey values 0..255, as (H, W) or (H, W, C) with C in 1, 3, 4."""
    try:
        arr = np.asarray(pixels, dtype=np.float64)
    except (ValueError, TypeError):
        raise BadImage("pixel array is ragged or not numeric") from None
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)) or min(arr.shape[:2]) < 1:
        raise BadImage(f"pixel array of shape {list(arr.shape)}; expected (H, W) or (H, W, 3|4)")
    if arr.shape[0] * arr.shape[1] > MAX_PIXELS:
        raise BadImage("pixel array is over the size limit")
    if not np.isfinite(arr).all() or arr.min() < 0 or arr.max() > 255:
        raise BadImage("pixel values must be finite and within 0..255")
    return Image.fromarray(arr.round().astype(np.uint8))


def to_input(img: Image.Image, spec: PreprocessSpec) -> tuple[np.ndarray, bool]:
    """Greyscale, resize to the spec's H x W if needed; returns the normalized (1, C, H, W) array and `resized`."""
    _, h, w = spec.input_shape
    grey = img.convert("L")
    resized = grey.size != (w, h)
    if resized:
        grey = grey.resize((w, h), Image.Resampling.BILINEAR)
    return spec.normalize(np.asarray(grey, np.uint8)[None]), resized
