"""CORS: which web pages may call the server from a browser (`serve --cors-origins`).

An origin pattern is `*` (any page), `scheme://host` (its default port), `scheme://host:PORT`,
or `scheme://host:*` (any port). The default, LOCAL_ORIGINS, admits pages served from this
machine (localhost, 127.0.0.1, [::1], any port, http or https): a chat UI or an HTML page on a
local dev server works out of the box, while a website on the internet that the user happens to
visit cannot read answers from (or script) a server on the user's machine. An empty list turns
CORS off. `null` (file:// pages, sandboxed frames of any site) is never admitted by a pattern.

The middleware answers a preflight (OPTIONS with Origin and Access-Control-Request-Method) from
an admitted origin with 204 and the Access-Control-* headers, and one from any other origin with
403 and none of them; an ordinary request from an admitted origin gets Access-Control-Allow-Origin
(the origin itself, `Vary: Origin`) and the headers clients read exposed; other requests pass
through untouched (a browser then withholds the answer from the page).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from ..errors import InvalidArgument

LOCAL_ORIGINS = tuple(f"{s}://{h}:*" for s in ("http", "https") for h in ("localhost", "127.0.0.1", "[::1]"))
ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "authorization, content-type"  # when the preflight names none
EXPOSE_HEADERS = "retry-after, retry-after-ms, x-request-id"
MAX_AGE = "600"  # seconds a browser may cache a preflight's answer
_PATTERN = re.compile(r"^(https?)://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(?::(\d{1,5}|\*))?$")
_DEFAULT_PORT = {"http": "80", "https": "443"}


def parse_origins(text: str | Sequence[str]) -> tuple[str, ...]:
    """A comma list (or sequence) of origin patterns -> a tuple of them, lower-cased and checked;
    InvalidArgument naming the first bad entry. '' or 'none': no origin."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for raw in items:
        item = raw.strip().lower()
        if not item or item == "none":
            continue
        if item != "*" and not _PATTERN.match(item):
            raise InvalidArgument(
                f"--cors-origins entry {raw.strip()!r} is not an origin pattern: expected *, scheme://host,"
                " scheme://host:PORT or scheme://host:* (scheme http or https)"
            )
        out.append(item)
    return tuple(out)


def admits(patterns: Sequence[str], origin: str) -> bool:
    """Whether the Origin header value `origin` matches one of the (parsed) patterns."""
    m = _PATTERN.match(origin.lower())
    if m is None:  # 'null', garbage, or a scheme other than http(s)
        return "*" in patterns and origin != "null"
    scheme, host, port = m.group(1), m.group(2), m.group(3) or _DEFAULT_PORT[m.group(1)]
    for pattern in patterns:
        if pattern == "*":
            return True
        p = _PATTERN.match(pattern)
        pport = p.group(3) or _DEFAULT_PORT[p.group(1)]
        if p.group(1) == scheme and p.group(2) == host and pport in ("*", port):
            return True
    return False


class CorsMiddleware:
    """ASGI middleware applying the module's rules with `patterns` (parse_origins)."""

    def __init__(self, app, patterns: Sequence[str]):
        self.app, self.patterns = app, tuple(patterns)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.patterns:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get("origin")
        if origin is None:
            return await self.app(scope, receive, send)
        allowed = admits(self.patterns, origin)
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            return await self._preflight(send, origin, allowed, headers.get("access-control-request-headers"))
        if not allowed:
            return await self.app(scope, receive, send)
        extra = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-expose-headers", EXPOSE_HEADERS.encode()),
            (b"vary", b"Origin"),
        ]

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return await self.app(scope, receive, send_with_cors)

    @staticmethod
    async def _preflight(send, origin: str, allowed: bool, requested: str | None) -> None:
        if allowed:
            status, body = 204, b""
            raw = [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"access-control-allow-methods", ALLOW_METHODS.encode()),
                (b"access-control-allow-headers", (requested or ALLOW_HEADERS).encode("latin-1")),
                (b"access-control-max-age", MAX_AGE.encode()),
                (b"vary", b"Origin"),
            ]
        else:
            status = 403
            error = {
                "message": f"origin {origin!r} is not allowed by --cors-origins",
                "type": "invalid_request_error",
                "param": None,
                "code": "cors_origin_not_allowed",
            }
            body = json.dumps({"error": error}).encode()
            raw = [(b"content-type", b"application/json"), (b"vary", b"Origin")]
        raw.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body, "more_body": False})
