"""The server's log: a start-up summary, one line per request, errors; text or JSON lines.

Every record goes to stderr with a UTC timestamp. Loggers and levels:
    specexport.server   INFO     the start-up summary (event "startup"), one line per finished
                                 request (event "request"; one cut by a timeout or the drain too)
                        ERROR    an unhandled error or a failed generation (with its traceback)
    uvicorn.error       INFO     listening, shutdown; WARNING/ERROR: uvicorn's own problems
    uvicorn.access      INFO     one HTTP access line per response (off below info)
`--log-level` sets the level of all of them. `--log-format text` writes
    2026-12-06T14:40:00.123Z INFO specexport.server request id=ab12 prompt_tokens=31 ...
and `--log-format json` one JSON object per line with the keys ts, level, logger, event (or
msg) and the record's fields.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOGGER = "specexport.server"
FORMATS = ("text", "json")
_OURS = "_specexport_handler"  # marks the handler configure() installed (replaced on a second call)

log = logging.getLogger(LOGGER)


def _utc(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    text = str(v)
    return json.dumps(text) if (not text or any(c in text for c in ' ="')) else text


class TextFormatter(logging.Formatter):
    """`TIMESTAMP LEVEL LOGGER MESSAGE key=value ...` (values with spaces quoted)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        line = f"{_utc(record.created)} {record.levelname} {record.name} {record.getMessage()}"
        if fields:
            line += " " + " ".join(f"{k}={_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event (a record with fields) or msg, fields."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        doc: dict[str, Any] = {"ts": _utc(record.created), "level": record.levelname, "logger": record.name}
        doc["event" if fields is not None else "msg"] = record.getMessage()
        doc.update(fields or {})
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def configure(log_format: str = "text", level: str = "info", stream=None) -> logging.Handler:
    """Send specexport's and uvicorn's records to `stream` (stderr) in `log_format` at `level`
    (the root logger's handler; uvicorn is then started with log_config=None)."""
    if log_format not in FORMATS:
        from ..errors import InvalidArgument

        raise InvalidArgument(f"log format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    setattr(handler, _OURS, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    numeric = logging.getLevelName(level.upper())
    for name in ("", LOGGER, "uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(numeric)
    return handler


def startup(gen, config, load_seconds: float | None) -> dict:
    """The start-up summary's fields (logged once, before the listener opens)."""
    m = gen.manifest
    fields = {
        "model": config.model_name or m.name,
        "target": f"{m.target.architecture} {m.target.num_layers} layers {m.target.precision}",
        "draft": "none" if m.draft is None else f"{m.draft.kind} {m.draft.precision}",
        "proposer": gen.resolve_proposer(config.proposer),
        "slots": config.max_batch,
        "max_queue": config.max_queue,
        "max_context": m.max_context,
        "listen": f"{config.host}:{config.port}",
        "api_key": config.api_key is not None,
        "cors_origins": ",".join(config.cors_origins) or "none",
    }
    if load_seconds is not None:
        fields["load_seconds"] = round(load_seconds, 2)
    return fields


def request_line(job, outcome) -> dict:
    """The fields of one ended request (worker.Job, responses.Outcome)."""
    s = outcome.stats
    ended = job.ended if job.ended is not None else time.monotonic()
    return {
        "id": job.id,
        "prompt_tokens": s.prompt_tokens,
        "new_tokens": s.new_tokens,
        "tok_s": round(s.tokens_per_second, 1),
        "acceptance": round(s.acceptance_rate, 3),
        "tokens_per_call": round(s.mean_accepted_length, 2),
        "proposer": outcome.proposer,
        "gamma": outcome.gamma if outcome.gamma is not None else outcome.gamma_policy,
        "finish": outcome.interrupted or outcome.finish_reason,
        "queue_s": round(outcome.queue_seconds, 3),
        "ttft_s": None if outcome.ttft_seconds is None else round(outcome.ttft_seconds, 3),
        "total_s": round(ended - job.arrived, 3),
    }


def log_request(job, outcome) -> None:
    log.info("request", extra={"fields": request_line(job, outcome)})


def log_startup(gen, config, load_seconds: float | None = None) -> None:
    log.info("startup", extra={"fields": startup(gen, config, load_seconds)})
