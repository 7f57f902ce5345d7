"""Server settings (the `serve` command's options), checked once at start."""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import math
from dataclasses import dataclass

from ..errors import InvalidArgument
from .cors import LOCAL_ORIGINS, parse_origins

LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* and /metrics need `Authorization: Bearer KEY`
    max_queue: int = 16  # requests waiting behind the running one; one more gets 429
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    request_timeout: float = 600.0  # seconds from arrival: queued past it -> 503, running past it -> cut
    drain_seconds: float = 10.0  # on SIGTERM, how long in-flight requests may still run before they are cut
    stall_seconds: float = 30.0  # a streaming client that reads nothing for this long is treated as gone
    model_name: str | None = None  # the id /v1/models lists (None: the artifact's manifest name)
    proposer: str | None = None  # default proposer of requests that name none (None: the artifact's)
    max_batch: int = 1  # requests generating at once (> 1: the artifact's batch graph, batch_worker.py)
    share_prefix_cache: bool = False  # cached prompt prefixes are shared across API keys (prefix_cache.py)
    cors_origins: tuple[str, ...] = LOCAL_ORIGINS  # web pages that may call from a browser (cors.py); () = none
    web_page: bool = True  # GET / serves the chat page that shows speculation (page.py)
    body_seconds: float = 30.0  # a request body not complete this long after its headers gets 408

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise InvalidArgument(f"port must be an integer in 0..65535, got {self.port!r}")
        if (
            not isinstance(self.max_queue, int)
            or isinstance(self.max_queue, bool)
            or not 0 <= self.max_queue <= 100_000
        ):
            raise InvalidArgument(f"max_queue must be an integer in 0..100000, got {self.max_queue!r}")
        if not isinstance(self.max_body_bytes, int) or not 1024 <= self.max_body_bytes <= 1 << 30:
            raise InvalidArgument(f"max_body_bytes must be an integer in 1024..{1 << 30}, got {self.max_body_bytes!r}")
        for name in ("request_timeout", "stall_seconds", "body_seconds"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InvalidArgument(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if (
            not isinstance(self.drain_seconds, (int, float))
            or not math.isfinite(self.drain_seconds)
            or self.drain_seconds < 0
        ):
            raise InvalidArgument(f"drain_seconds must be a finite number of seconds >= 0, got {self.drain_seconds!r}")
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise InvalidArgument("api_key must be a non-empty string without surrounding whitespace")
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool) or not 1 <= self.max_batch <= 64:
            raise InvalidArgument(f"max_batch must be an integer in 1..64, got {self.max_batch!r}")
        if not isinstance(self.share_prefix_cache, bool):
            raise InvalidArgument(f"share_prefix_cache must be true or false, got {self.share_prefix_cache!r}")
        object.__setattr__(self, "cors_origins", parse_origins(self.cors_origins))
        if self.model_name is not None and not self.model_name:
            raise InvalidArgument("model_name must be a non-empty string")

    @property
    def loopback(self) -> bool:
        """Whether `host` only accepts connections from this machine."""
        if self.host in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: only 'localhost' is known to be local
            return False

    def exposure_warning(self) -> str | None:
        """The warning `serve` prints when the server is reachable from other machines without a key."""
        if self.loopback or self.api_key is not None:
            return None
        return (
            f"warning: serving on {self.host}:{self.port} without --api-key: anyone who can reach this"
            " address can use the model (bind 127.0.0.1, or set --api-key)"
        )


def prefix_namespace(authorization: str | None, shared: bool) -> str:
    """A request's prefix pool namespace: a digest of its Authorization header ('' without one, or
    when the server shares prefixes across keys)."""
    if shared or not authorization:
        return ""
    return hashlib.sha256(authorization.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def add_prefix_arguments(srv: argparse.ArgumentParser) -> None:
    """The `serve` options of the prefix pool (prefix_cache.py, docs/serving.md)."""
    srv.add_argument(
        "--prefix-cache-mib",
        type=float,
        default=None,
        help="memory bound of the cache of prompt prefixes reused across requests, in MiB (0: off;"
        " default: as much as the target's and draft's own caches at max_context)",
    )
    srv.add_argument(
        "--share-prefix-cache",
        action="store_true",
        help="let requests with different API keys reuse each other's cached prefixes (default: one pool"
        " namespace per Authorization header, since a shared cache shows through timing what others sent)",
    )


def prefix_overrides(args: argparse.Namespace) -> dict:
    """load()'s config overrides of the prefix options: {} or {"prefix_cache_bytes": N}."""
    mib = args.prefix_cache_mib
    if mib is None:
        return {}
    if not math.isfinite(mib) or mib < 0:
        raise InvalidArgument(f"--prefix-cache-mib must be a number of MiB >= 0, got {mib!r}")
    return {"prefix_cache_bytes": int(mib * (1 << 20))}
