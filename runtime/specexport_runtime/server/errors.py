"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every error the server answers on purpose is an ApiError; `param` names the request field at
fault (dotted and indexed, e.g. `messages[1].role`) or is None when no field is.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER = "server_error"
UNAVAILABLE = "service_unavailable_error"


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = INVALID_REQUEST
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, INVALID_REQUEST, param, code)


def unsupported(param: str, what: str) -> ApiError:
    """A field the server does not implement: rejected, never silently ignored."""
    return ApiError(
        400, f"{param} is not supported by this server: {what}", INVALID_REQUEST, param, "unsupported_parameter"
    )


def check_api_key(key: bytes | None, header: str | None) -> None:
    """Raise 401 unless `header` (the request's Authorization value) is 'Bearer KEY' for `key`
    (None: no key is set, every request passes); the token is compared in constant time."""
    if key is None:
        return
    if header is None:
        raise ApiError(
            401,
            "missing API key: send the header 'Authorization: Bearer KEY'",
            INVALID_REQUEST,
            None,
            "invalid_api_key",
        )
    scheme, _, token = header.partition(" ")
    if not hmac.compare_digest(token.strip().encode(), key) or scheme.lower() != "bearer":
        raise ApiError(401, "incorrect API key in the Authorization header", INVALID_REQUEST, None, "invalid_api_key")
