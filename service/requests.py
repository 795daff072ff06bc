"""What a classify request says, read without waste.

Options come from the query string, the `X-Deadline-Ms` header and (JSON, multipart) the body; each option
is given once. Images come as JSON (base64 PNG/JPEG or pixel arrays), multipart files, the raw encoded
file as the whole body (`image/png`, `image/jpeg`, `application/octet-stream`), or a raw tensor
(`application/x-tensor` with `dtype` and `shape` in the query).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import orjson
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.types import Receive, Scope

from models.compat import timeout
from models.preprocess import PreprocessSpec
from service.errors import ApiError, BadImage, ClientGone, InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from service.images import Pending, open_bytes, open_item, open_tensor, parse_shape
from service.schemas import MAX_BATCH_IMAGES, ClassifyOptions

JSON, MULTIPART, TENSOR = "application/json", "multipart/form-data", "application/x-tensor"
ENCODED = ("image/png", "image/jpeg", "application/octet-stream")
SINGLE_MEDIA = (JSON, MULTIPART, *ENCODED, TENSOR)
BATCH_MEDIA = (JSON, MULTIPART, TENSOR)
TENSOR_FIELDS = ("dtype", "shape")
# JSON bodies up to this size are parsed on the event loop (orjson: well under 0.1 ms); larger in a thread.
INLINE_MAX_JSON = 64 * 1024


@dataclass
class Head:
    """The request line and headers: everything known before the body is read."""

    media: str
    fields: dict[str, str] = field(default_factory=dict)  # options from the query string and headers
    tensor: dict[str, str] = field(default_factory=dict)  # dtype, shape

    @property
    def options_complete(self) -> bool:
        """The body cannot add options (a binary body), so they can be checked before reading it."""
        return self.media not in (JSON, MULTIPART)


def read_head(scope: Mapping[str, Any], batch: bool) -> Head:
    media, deadline = "", None
    for name, value in scope["headers"]:
        if name == b"content-type":
            media = value.decode("latin-1").split(";", 1)[0].strip().lower()
        elif name == b"x-deadline-ms":
            deadline = value.decode("latin-1")
    allowed = BATCH_MEDIA if batch else SINGLE_MEDIA
    if media not in allowed:
        raise UnsupportedMediaType(f"content type {media or 'none'} is not accepted; send one of {', '.join(allowed)}")
    head = Head(media)
    for key, value in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True):
        target = head.tensor if key in TENSOR_FIELDS else head.fields
        if key in target:
            raise InvalidRequest(f"{key}: given twice in the query string")
        target[key] = value
    if deadline is not None:
        if "deadline_ms" in head.fields:
            raise InvalidRequest("deadline_ms: given both as X-Deadline-Ms and in the query string; give it once")
        head.fields["deadline_ms"] = deadline
    if head.tensor and media != TENSOR:
        raise InvalidRequest(f"{', '.join(head.tensor)}: only an {TENSOR} body takes dtype and shape")
    return head


async def read_body(receive: Receive, limit: int, time_limit: Callable[[], tuple[float, ApiError]]) -> bytes:
    """The whole body, at most `limit` bytes. When it is not all here at the first read, `time_limit()` says how long
    the rest may take and the error that answers it late (worked out only then: most bodies come in one read)."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise PayloadTooLarge(f"body is over the limit of {limit} bytes")
        return body
    chunks, size = [body], len(body)
    timeout_s, on_timeout = time_limit()
    try:
        async with timeout(timeout_s):
            while message.get("more_body", False):
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:  # chunked bodies carry no Content-Length to refuse up front
                    raise PayloadTooLarge(f"body is over the limit of {limit} bytes")
                chunks.append(chunk)
    except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
        raise on_timeout from None
    return b"".join(chunks)


def validate_options(*sources: dict[str, Any]) -> ClassifyOptions:
    """Options from several places (query, header, body); each may be given in one place only."""
    merged: dict[str, Any] = {}
    for source in sources:
        for key, value in source.items():
            if key in merged:
                raise InvalidRequest(f"{key}: given both in the query string or headers and in the body; give it once")
            merged[key] = value
    try:
        return ClassifyOptions.model_validate(merged)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"{where}: {first['msg']}" if where else first["msg"]) from None


def parse_json(body: bytes, batch: bool) -> tuple[dict[str, Any], list[Any]]:
    """The option fields and the images (base64 text or pixel arrays, not yet opened)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidRequest("body is not valid JSON") from None
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object")
    if not batch:
        if "image" not in data:
            raise InvalidRequest("image: Field required")
        return data, [data.pop("image")]
    images = data.pop("images", None)
    if not isinstance(images, list) or not 1 <= len(images) <= MAX_BATCH_IMAGES:
        raise InvalidRequest(f"images: a list of 1 to {MAX_BATCH_IMAGES} images is required")
    return data, images


def open_all(items: list[Any], spec: PreprocessSpec) -> list[Pending]:
    """Open every image of a request (read headers, check limits); a bad one names its index in a batch."""
    if len(items) == 1:
        return [_open(items[0], spec)]
    pending = []
    for i, item in enumerate(items):
        try:
            pending.append(_open(item, spec))
        except BadImage as e:
            raise BadImage(f"images.{i}: {e.message}") from None
    return pending


def _open(item: Any, spec: PreprocessSpec) -> Pending:
    if isinstance(item, Pending):
        return item
    return open_bytes(item, spec) if isinstance(item, bytes) else open_item(item, spec)


async def parse_multipart(scope: Scope, body: bytes, batch: bool) -> tuple[dict[str, Any], list[bytes]]:
    """Options as form fields; the image as a file field `file` (the batch form: one or more `file` fields)."""
    sent = False

    async def replay() -> dict[str, Any]:  # the body is already read (bounded in size and time)
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(scope, replay).form(max_files=MAX_BATCH_IMAGES, max_fields=16)
    except Exception as e:  # python-multipart and Starlette raise several types for a malformed body
        # Starlette's HTTPException carries the parser's own words ("Missing boundary in multipart.")
        detail = getattr(e, "detail", None)
        why = detail if isinstance(detail, str) else type(e).__name__
        raise InvalidRequest(f"malformed multipart body: {why}") from None
    files = [v for k, v in form.multi_items() if k == "file" and isinstance(v, UploadFile)]
    if not files or (not batch and len(files) > 1):
        need = "one or more file fields" if batch else "one file field"
        raise InvalidRequest(f"file: a multipart request needs the image as {need} named 'file'")
    fields = {k: v for k, v in form.multi_items() if k != "file"}
    if any(not isinstance(v, str) for v in fields.values()):
        raise InvalidRequest("only the 'file' fields may hold files")
    return fields, [await f.read() for f in files]


def parse_binary(head: Head, body: bytes, batch: bool, spec: PreprocessSpec) -> list[Pending]:
    if head.media != TENSOR:
        return [open_bytes(body, spec)]
    missing = [k for k in TENSOR_FIELDS if k not in head.tensor]
    if missing:
        raise InvalidRequest(f"{', '.join(missing)}: an {TENSOR} body needs dtype and shape in the query string")
    shape = parse_shape(head.tensor["shape"])
    items = open_tensor(body, head.tensor["dtype"], shape, spec, batch)
    if not 1 <= len(items) <= MAX_BATCH_IMAGES:
        raise InvalidRequest(f"shape: a batch of 1 to {MAX_BATCH_IMAGES} images is accepted")
    return items
