"""An optional API key: `Authorization: Bearer <key>` on the /v1 routes (and /metrics when asked); health is open.

Checked before anything else, in the HTTP parser's admission (service/admission.py) and in the ASGI
middleware (service/app.py) for the routes the parser does not admit. The comparison takes the same time
however much of the key is right.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from service.errors import Unauthorized

PROTECTED_PREFIX = "/v1/"


class ApiKey:
    def __init__(self, key: str | None, protect_metrics: bool = False) -> None:
        self._key = key.encode() if key else None
        self._metrics = protect_metrics

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def protects(self, path: str) -> bool:
        return self._key is not None and (path.startswith(PROTECTED_PREFIX) or (self._metrics and path == "/metrics"))

    def check(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """Raise Unauthorized (401) unless the headers carry the key as a bearer token."""
        assert self._key is not None
        for name, value in headers:
            if name.lower() == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
                    return
                raise Unauthorized(
                    "the API key is not right", headers={"WWW-Authenticate": 'Bearer error="invalid_token"'}
                )
        raise Unauthorized(
            "this route needs an API key: Authorization: Bearer <key>", headers={"WWW-Authenticate": "Bearer"}
        )
