"""`specexport-runtime serve`: an OpenAI-compatible local HTTP server for one artifact.

The serve extra (`pip install ./runtime[serve]`: uvicorn, starlette, prometheus_client) is
imported by the modules below this package, never by the runtime itself: importing
`specexport_runtime.server` costs nothing and `missing_serve_extra()` says whether it can run.

Modules: config (ServerConfig), errors (ApiError, OpenAI-style error JSON), schemas (request
validation, with messages for the chat messages and the prompt, fields for scalar fields),
worker (the one thread that owns the SpecGenerator, fed by a bounded FIFO queue), responses
(response and SSE chunk bodies, the `speculative` object), metrics (Prometheus), app (Starlette
routes and ASGI responses), run (uvicorn with a draining shutdown), backpressure (Retry-After),
cors (which web pages may call), logs (start-up summary, one line per request), options (the
`serve` options of those three).
"""

from __future__ import annotations

import importlib.util

from ..errors import SpecExportError

SERVE_EXTRA = "pip install ./runtime[serve]"
SERVE_MODULES = ("uvicorn", "starlette", "prometheus_client")


def missing_serve_extra() -> str | None:
    """A one-line error naming the missing modules of the serve extra, or None when all are installed."""
    missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return f"the server needs the serve extra ({', '.join(missing)} not installed): {SERVE_EXTRA}"


class ServeExtraMissing(SpecExportError):
    """The serve extra (uvicorn, starlette, prometheus_client) is not installed."""
