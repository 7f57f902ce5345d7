"""`serve` options of the HTTP front that are not the generator's: CORS, the web page, the body
timeout and the log (their behaviour: cors.py, page.py, app.read_json, logs.py; docs/serving.md)."""

from __future__ import annotations

import argparse

from .cors import LOCAL_ORIGINS
from .logs import FORMATS


def http_settings(args: argparse.Namespace) -> dict:
    """The ServerConfig fields of add_http_arguments' options."""
    return {"cors_origins": args.cors_origins, "web_page": not args.no_web_page, "body_seconds": args.body_seconds}


def add_http_arguments(srv: argparse.ArgumentParser) -> None:
    srv.add_argument(
        "--cors-origins",
        default=",".join(LOCAL_ORIGINS),
        metavar="LIST",
        help="web pages that may call the server from a browser: a comma list of origins (scheme://host,"
        " scheme://host:PORT, scheme://host:* for any port, or * for any page); 'none' turns CORS off"
        " (default: pages served from this machine, http(s)://localhost, 127.0.0.1 and [::1] on any"
        " port; a website elsewhere cannot read answers; docs/serving.md#cors)",
    )
    srv.add_argument(
        "--body-seconds",
        type=float,
        default=30.0,
        help="a request body that has not fully arrived this many seconds after its headers gets 408 and"
        " the connection is closed (a stalled upload is not held open; default 30)",
    )
    srv.add_argument(
        "--no-web-page",
        action="store_true",
        help="do not serve the chat page at / (default: served; it shows how each token came, acceptance and"
        " tok/s as they happen; no external resources)",
    )
    srv.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default="info",
        help="log level of the server and uvicorn (default info: a start-up summary, one line per request"
        " and one access line per response; docs/serving.md#logs)",
    )
    srv.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="log lines on stderr: text (timestamp level logger message key=value ...) or json (one"
        " object per line); a start-up summary, then one line per request (default text)",
    )
