"""`serve` options of the HTTP front that are not the generator's: CORS, the web page, the body
timeout and the log (their behaviour: cors.py, page.py, app.read_json, logs.py; docs/serving.md),
and the cluster's (cluster/; docs/serving.md#more-than-one-machine)."""

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


def add_cluster_arguments(srv: argparse.ArgumentParser) -> None:
    """More than one machine: a Ray Serve cluster of replicas (docs/serving.md#more-than-one-machine)."""
    group = srv.add_argument_group(
        "cluster (Ray Serve; needs pip install './runtime[cluster]')",
        "With --replicas or --autoscale the artifact is served by replicas on a Ray cluster; each replica"
        " opens and verifies it (a folder or a .spx at the same path on every node). --max-queue is then"
        " the cluster's queue, --max-batch each replica's slots, --threads each replica's threads; this"
        " process serves HTTP on --host/--port and relays each request to a replica.",
    )
    scale = group.add_mutually_exclusive_group()
    scale.add_argument("--replicas", type=int, default=None, metavar="N", help="a fixed number of replicas")
    scale.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN:MAX",
        help="replicas follow the load (queued + running requests) between MIN and MAX",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster ('auto': the one started on this machine with `ray start`; or HOST:PORT);"
        " default: start a local one for this command",
    )
    group.add_argument(
        "--target-ongoing",
        type=float,
        default=None,
        help="--autoscale: requests per replica (running + queued) the autoscaler aims at (default: --max-batch)",
    )
    group.add_argument(
        "--upscale-delay", type=float, default=5.0, help="--autoscale: seconds above target before adding (default 5)"
    )
    group.add_argument(
        "--downscale-delay",
        type=float,
        default=30.0,
        help="--autoscale: seconds below target before removing a replica (default 30)",
    )
    group.add_argument(
        "--replica-queue",
        type=int,
        default=1,
        help="requests that may wait at a replica besides its running ones, so that the next one starts"
        " without a round trip to this process (default 1; 0: requests go only to replicas with a free slot)",
    )
    group.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="CPUs Ray reserves per replica when placing it (default 1; match --threads)",
    )
