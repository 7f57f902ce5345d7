"""The Ray Serve application of one artifact, and `serve --replicas/--autoscale` around it.

    HTTP -> Ray Serve proxy (head node) -> Ingress (ingress.Relay, 1 replica, 0 CPUs)
         -> DeploymentHandle -> SpecReplica x N (replica.py: the artifact, the server's app)

Ray Serve does the rest: it places replicas on the cluster's nodes, routes each request to a
replica with a free slot, queues at most `max_queue` requests, scales the replica count on
ongoing + queued requests (autoscale), health-checks replicas (`check_health`) and restarts
the ones that die.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ray import serve

from ..errors import SpecExportError
from .config import SHUTDOWN_SLACK, ClusterConfig
from .ingress import Relay
from .replica import REFUSED, SpecReplica

REPLICA_DEPLOYMENT = "SpecReplica"
INGRESS_DEPLOYMENT = "Ingress"
INGRESS_ONGOING = 100_000  # the ingress only relays: the bound that matters is the replicas' queue
# Ray settings of a cluster this command starts (Ray's processes read them when they start; a set
# value wins): workers at normal priority (Ray starts them at nice 15, below its daemons), and the
# HTTP proxy's hop to the ingress over gRPC instead of Ray actor calls. docs/serving.md measures both.
RAY_ENVIRONMENT = {"RAY_worker_niceness": "0", "RAY_SERVE_PROXY_USE_GRPC": "1"}


class ClusterError(SpecExportError):
    """The cluster could not be started or joined, or the deployment failed."""


class IngressBase:
    """The ingress deployment's class: its ASGI app is a Relay to the replica deployment."""

    def __init__(self, replicas, config: ClusterConfig):
        app = serve.get_replica_context().app_name
        self.relay = Relay(
            replicas,
            config.queue,
            config.server.max_body_bytes,
            api_key=config.server.api_key,
            replicas=lambda: asyncio.to_thread(running_replicas, app),
            min_replicas=config.min_replicas,
        )

    def __serve_build_asgi_app__(self):
        return self.relay


def deployment(artifact: str | Path, config: ClusterConfig | None = None):
    """A Ray Serve Application serving `artifact` (a folder or a .spx at this path on every node).

    Run it with `serve.run(app, route_prefix="/")`, or compose it into your own; each replica
    opens and verifies the artifact itself (replica.py)."""
    config = config if config is not None else ClusterConfig()
    if not isinstance(config, ClusterConfig):
        raise TypeError(f"config must be a ClusterConfig, got {type(config).__name__}")
    replica = serve.deployment(SpecReplica, name=REPLICA_DEPLOYMENT, **config.ray_options())
    ingress = serve.deployment(
        serve.ingress()(IngressBase),
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=INGRESS_ONGOING,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replica.bind(os.path.abspath(artifact), config), config)


def running_replicas(app: str) -> int:
    """Replicas of `app`'s replica deployment in the RUNNING state (Ray's controller asked)."""
    status = serve.status().applications.get(app)
    if status is None or REPLICA_DEPLOYMENT not in status.deployments:
        return 0
    return status.deployments[REPLICA_DEPLOYMENT].replica_states.get("RUNNING", 0)


def refusal(text: str) -> str | None:
    """The one line a replica wrote when it refused the artifact, found in a deployment's status."""
    for line in text.splitlines():
        if REFUSED in line:
            return line[line.index(REFUSED) :].strip()
    return None


def _failure_line(config: ClusterConfig, artifact: str | Path, exc: RuntimeError) -> str:
    """One line for a failed deployment: a replica's refusal when there is one (Ray keeps the
    replicas' constructor errors in the deployment status), else Ray's last line."""
    try:
        status = serve.status().applications.get(config.name)
    except RuntimeError:  # Serve itself is gone
        status = None
    texts = [str(exc)] + ([d.message for d in status.deployments.values()] if status is not None else [])
    for text in texts:
        line = refusal(text)
        if line is not None:
            return line
    last = [part.strip() for part in str(exc).splitlines() if part.strip()]
    return f"the deployment of {artifact} failed: {last[-1] if last else type(exc).__name__}"


def deploy(artifact: str | Path, config: ClusterConfig, route_prefix: str = "/"):
    """serve.run the application under `config.name` at `route_prefix`; returns its handle. A
    deployment that fails (a replica refused the artifact, ...) raises ClusterError with one line."""
    try:
        return serve.run(deployment(artifact, config), name=config.name, route_prefix=route_prefix)
    except RuntimeError as exc:
        raise ClusterError(_failure_line(config, artifact, exc)) from None


def drain(config: ClusterConfig, signals: threading.Semaphore) -> bool:
    """Delete the application: each replica finishes its requests first (Ray waits for them, up to
    config.shutdown_grace). This command waits drain_seconds (+ SHUTDOWN_SLACK) for that, or until a second
    signal; then it returns whether the application is gone (a cluster it started is then shut
    down with whatever still runs: those clients see their connections close)."""
    deleting = threading.Thread(target=serve.delete, args=(config.name,), daemon=True)
    deleting.start()
    print(
        f"draining: running requests may finish for {config.server.drain_seconds:g} s (signal again to stop now)",
        file=sys.stderr,
    )
    deadline = time.monotonic() + config.server.drain_seconds + SHUTDOWN_SLACK
    while deleting.is_alive() and time.monotonic() < deadline:
        if signals.acquire(timeout=0.2):
            break
    if deleting.is_alive() and config.ray_address is not None:
        print(
            f"the application {config.name!r} is still draining on the cluster: Ray removes it once its requests end",
            file=sys.stderr,
        )
    return not deleting.is_alive()


def ray_environment() -> dict[str, str]:
    """Set RAY_ENVIRONMENT in this process's environment where unset (before ray.init starts a
    cluster); returns the values in effect."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in RAY_ENVIRONMENT}


def serve_cluster(artifact: str | Path, config: ClusterConfig) -> None:
    """Start (or join: config.ray_address) a Ray cluster, deploy, and serve until SIGINT/SIGTERM."""
    import ray

    warning = config.server.exposure_warning()
    if warning:
        print(warning, file=sys.stderr)
    if config.ray_address is None:  # a cluster this command starts (a joined one has its own settings)
        ray_environment()
    try:
        ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterError(
            f"cannot start or join Ray at {config.ray_address or 'a new local cluster'}: {exc}"
        ) from None
    drained = True  # nothing left running that Serve's own shutdown should wait for
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": config.server.host, "port": config.server.port})
        try:
            deploy(artifact, config)
        except ClusterError:
            if config.ray_address is not None:  # a joined cluster keeps running: leave no failed app on it
                serve.delete(config.name)
            raise
        scale = (
            f"{config.replicas} replicas"
            if config.autoscale is None
            else f"{config.autoscale[0]}..{config.autoscale[1]} replicas (autoscaling)"
        )
        print(
            f"serving {artifact} on http://{config.server.host}:{config.server.port}/v1 with {scale}", file=sys.stderr
        )
        signals = threading.Semaphore(0)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: signals.release())
        signals.acquire()
        drained = drain(config, signals)
    finally:
        if config.ray_address is None and drained:  # the cluster this command started, idle
            serve.shutdown()
        ray.shutdown()
