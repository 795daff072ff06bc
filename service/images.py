"""Request images -> model input: PNG/JPEG bytes, base64 text, nested pixel arrays, and raw tensors.

Each image is first *opened* (cheap: the PNG/JPEG header, an array's shape) to learn its pixel count, and
decoded afterwards. The caller decodes small images on the event loop and large ones in a thread: on this
repository's 2-vCPU machine, decoding a 28x28 PNG and normalizing it took about 30 us, 128x128 about 85 us,
256x256 about 300 us and 1024x1024 about 5.7 ms (see INLINE_MAX_PIXELS).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from models.preprocess import PreprocessSpec
from service.errors import BadImage

MAX_PIXELS = 4096 * 4096  # refuse decompression bombs before decoding them
# Decoding this many pixels or fewer stays under ~0.1 ms: done on the event loop; more goes to a thread.
INLINE_MAX_PIXELS = 128 * 128
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TENSOR_DTYPES: dict[str, np.dtype[Any]] = {"uint8": np.dtype(np.uint8), "float32": np.dtype("<f4")}

Input = tuple[np.ndarray, bool]  # (1, C, H, W) model input, and whether the image was resized


@dataclass
class Pending:
    """One opened image: its pixel count is known, its decoding is still to do."""

    pixels: int
    decode: Callable[[], Input]


# What PIL raises for a damaged file: OSError (truncated data), ValueError, a decompression bomb, and SyntaxError
# (PIL's "broken PNG file" for a chunk whose type is not four letters, found by tests/test_properties.py).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def undecodable(e: Exception) -> BadImage:
    """The refusal of an image PIL or zlib could not decode, in words rather than an exception's name alone.

    The exception's type says little of the cause: a grey PNG whose image data stops early raises ValueError here
    (PIL's "not enough image data"), the same cut in another PNG OSError, a damaged chunk header SyntaxError."""
    why = "too many pixels" if isinstance(e, Image.DecompressionBombError) else "the file is truncated or corrupt"
    return BadImage(f"cannot decode the image: {why} ({type(e).__name__})")


def open_bytes(data: bytes, spec: PreprocessSpec) -> Pending:
    """A PNG or JPEG file: the header is read and checked now, the pixels on decode()."""
    plain = open_plain_png(data, spec)
    if plain is not None:
        return plain
    try:
        img = Image.open(io.BytesIO(data), formats=("PNG", "JPEG"))
    except UnidentifiedImageError:
        raise BadImage("cannot decode the image: not a PNG or JPEG file") from None
    except DECODE_ERRORS as e:
        raise undecodable(e) from None
    if img.width * img.height > MAX_PIXELS:
        raise BadImage(f"image of {img.width}x{img.height} pixels is over the limit of {MAX_PIXELS}")

    def decode() -> Input:
        try:
            img.load()
        except DECODE_ERRORS as e:
            raise undecodable(e) from None
        return to_input(img, spec)

    return Pending(img.width * img.height, decode)


def open_plain_png(data: bytes, spec: PreprocessSpec) -> Pending | None:
    """The common PNG, 8-bit grey and not interlaced, read without PIL's file parser; None for any other file.

    PIL's `Image.open` + `load` spends most of its time in Python around the chunks; here the chunks are
    walked with `struct` and the image data goes straight to PIL's own zlib decoder (which undoes PNG's row
    filters), through the public `Image.frombytes`. Measured on this repository's 2-vCPU machine on a 28x28
    Fashion-MNIST PNG (2026-11-25): 197 us -> 85 us. Anything unusual (palette, 16-bit, alpha, interlace,
    a malformed chunk) falls back to PIL's full parser, which also gives the error messages.
    """
    if not data.startswith(PNG_SIGNATURE):
        return None
    pos, end, header, parts = len(PNG_SIGNATURE), len(data), None, []
    while pos + 12 <= end:
        length, kind = struct.unpack_from(">I4s", data, pos)
        if pos + 12 + length > end:
            return None
        if kind == b"IHDR" and length == 13:
            header = struct.unpack_from(">IIBBBBB", data, pos + 8)
        elif kind == b"IDAT":
            parts.append(data[pos + 8 : pos + 8 + length])
        elif kind == b"IEND":
            break
        pos += 12 + length
    else:
        return None  # no IEND: truncated
    if header is None or not parts or header[2:] != (8, 0, 0, 0, 0):  # depth 8, grey, deflate, filter 0, progressive
        return None
    width, height = header[0], header[1]
    if width < 1 or height < 1:
        return None
    if width * height > MAX_PIXELS:
        raise BadImage(f"image of {width}x{height} pixels is over the limit of {MAX_PIXELS}")

    def decode() -> Input:
        try:
            img = Image.frombytes("L", (width, height), b"".join(parts), "zip", "L")
        except (OSError, ValueError) as e:  # corrupt or short deflate data
            raise undecodable(e) from None
        return to_input(img, spec)

    return Pending(width * height, decode)


def open_base64(text: str, spec: PreprocessSpec) -> Pending:
    if text.startswith("data:"):
        text = text.split(",", 1)[-1]
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadImage("image is not valid base64") from None
    return open_bytes(data, spec)


def open_array(pixels: list[Any], spec: PreprocessSpec) -> Pending:
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
    return Pending(arr.shape[0] * arr.shape[1], lambda: to_input(Image.fromarray(arr.round().astype(np.uint8)), spec))


def open_item(item: object, spec: PreprocessSpec) -> Pending:
    """One JSON image: base64 text or a nested pixel array."""
    if isinstance(item, str):
        return open_base64(item, spec)
    if isinstance(item, list):
        return open_array(item, spec)
    raise BadImage("an image is base64 text or a nested array of grey values")


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise BadImage(f"shape {text!r} is not comma-separated integers") from None
    if not shape or min(shape) < 1:
        raise BadImage(f"shape {text!r} must be positive integers")
    return shape


def open_tensor(data: bytes, dtype: str, shape: tuple[int, ...], spec: PreprocessSpec, batch: bool) -> list[Pending]:
    """A raw little-endian C-order tensor: a leading N axis for the batch form.

    uint8: grey pixels 0..255 of any size, (H, W) or (1, H, W), normalized and resized like an image.
    float32: already preprocessed model input, exactly the model's (C, H, W).
    """
    if dtype not in TENSOR_DTYPES:
        raise BadImage(f"dtype {dtype!r} is not accepted; send uint8 or float32")
    np_dtype = TENSOR_DTYPES[dtype]
    if math.prod(shape) * np_dtype.itemsize != len(data):
        raise BadImage(
            f"a {dtype} tensor of shape {list(shape)} has {math.prod(shape) * np_dtype.itemsize} bytes, "
            f"the body has {len(data)}"
        )
    arr = np.frombuffer(data, np_dtype).reshape(shape)
    items = arr if batch else arr[None]
    one = items.shape[1:]
    if dtype == "float32":
        if one != tuple(spec.input_shape):
            raise BadImage(
                f"a float32 tensor is model input of shape {list(spec.input_shape)} per image, got {list(one)}"
            )
        if not np.isfinite(items).all():
            raise BadImage("tensor values must be finite")
        return [Pending(math.prod(one[1:]), _ready(x[None].astype(np.float32))) for x in items]
    if len(one) == 3 and one[0] == 1:
        items, one = items[:, 0], one[1:]
    if len(one) != 2:
        raise BadImage(f"a uint8 tensor holds grey images of shape (H, W) or (1, H, W), got {list(one)}")
    if one[0] * one[1] > MAX_PIXELS:
        raise BadImage("tensor image is over the size limit")
    if one == tuple(spec.input_shape[1:]):  # the model's size: normalize directly, no PIL round trip
        return [Pending(one[0] * one[1], _normalized(x, spec)) for x in items]
    return [Pending(one[0] * one[1], _resized(x, spec)) for x in items]


def _ready(x: np.ndarray) -> Callable[[], Input]:
    return lambda: (x, False)


def _normalized(pixels: np.ndarray, spec: PreprocessSpec) -> Callable[[], Input]:
    return lambda: (spec.normalize(pixels[None]), False)


def _resized(pixels: np.ndarray, spec: PreprocessSpec) -> Callable[[], Input]:
    return lambda: to_input(Image.fromarray(pixels), spec)


def to_input(img: Image.Image, spec: PreprocessSpec) -> Input:
    """Greyscale, resize to the spec's H x W if needed; returns the normalized (1, C, H, W) array and `resized`."""
    _, h, w = spec.input_shape
    grey = img if img.mode == "L" else img.convert("L")
    resized = grey.size != (w, h)
    if resized:
        grey = grey.resize((w, h), Image.Resampling.BILINEAR)
    return spec.normalize(np.asarray(grey, np.uint8)[None]), resized
