"""The Ray Serve application of one artifact, and `serve --replicas/--autoscale` around it.

`serve --replicas/--autoscale` (serve_cluster): Ray Serve runs the replica deployment alone, and
the command's own process is the HTTP front (front.py):

    HTTP -> this process (uvicorn, ingress.Relay) -> DeploymentHandle -> SpecReplica x N

`deployment()` (for users who compose their own Ray Serve applications): the same Relay as an
ingress deployment behind Ray's HTTP proxy, which adds two hops (docs/serving.md measures them):

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
from ..server.logs import configure, log
from .config import SHUTDOWN_SLACK, ClusterConfig
from .front import Front, listen
from .ingress import Relay, front_app
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


def relay(handle, config: ClusterConfig, app: str) -> Relay:
    """The ingress app relaying to `app`'s replicas through `handle` (a DeploymentHandle of them)."""
    return Relay(
        handle,
        config.queue,
        config.server.max_body_bytes,
        api_key=config.server.api_key,
        replicas=lambda: asyncio.to_thread(running_replicas, app),
        min_replicas=config.min_replicas,
        slots=config.slots,
        replica_queue=config.replica_queue,
    )


class IngressBase:
    """The ingress deployment's class: its ASGI app is a Relay to the replica deployment."""

    def __init__(self, replicas, config: ClusterConfig):
        self.relay = relay(replicas, config, serve.get_replica_context().app_name)
        self.front = front_app(self.relay, config.server.cors_origins)

    def __serve_build_asgi_app__(self):
        return self.front


def replica_application(artifact: str | Path, config: ClusterConfig):
    """The replica deployment alone, bound to `artifact` (no HTTP route of its own)."""
    replica = serve.deployment(SpecReplica, name=REPLICA_DEPLOYMENT, **config.ray_options())
    return replica.bind(os.path.abspath(artifact), config)


def deployment(artifact: str | Path, config: ClusterConfig | None = None):
    """A Ray Serve Application serving `artifact` (a folder or a .spx at this path on every node)
    over HTTP through Ray's proxy.

    Run it with `serve.run(app, route_prefix="/")`, or compose it into your own; each replica
    opens and verifies the artifact itself (replica.py)."""
    config = config if config is not None else ClusterConfig()
    if not isinstance(config, ClusterConfig):
        raise TypeError(f"config must be a ClusterConfig, got {type(config).__name__}")
    ingress = serve.deployment(
        serve.ingress()(IngressBase),
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=INGRESS_ONGOING,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replica_application(artifact, config), config)


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


def deploy(artifact: str | Path, config: ClusterConfig, route_prefix: str | None = "/"):
    """serve.run the application under `config.name`; returns its ingress's handle. route_prefix
    None deploys the replicas alone (replica_application: the handle is theirs, for a Relay
    outside Ray), else deployment() at that HTTP route. A deployment that fails (a replica refused
    the artifact, ...) raises ClusterError with one line."""
    app = replica_application(artifact, config) if route_prefix is None else deployment(artifact, config)
    try:
        return serve.run(app, name=config.name, route_prefix=route_prefix)
    except RuntimeError as exc:
        raise ClusterError(_failure_line(config, artifact, exc)) from None


def drain(config: ClusterConfig, signals: threading.Semaphore) -> bool:
    """Delete the application: each replica finishes its requests first (Ray waits for them, up to
    config.shutdown_grace). This command waits drain_seconds (+ SHUTDOWN_SLACK) for that, or until a second
    signal; then it returns whether the application is gone (the front then cuts what still runs,
    each client told with an error, and a cluster this command started is shut down)."""
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
            f"the application {config.name!r} is still being removed from the cluster: its requests are cut now",
            file=sys.stderr,
        )
    return not deleting.is_alive()


def ray_environment() -> dict[str, str]:
    """Set RAY_ENVIRONMENT in this process's environment where unset (before ray.init starts a
    cluster); returns the values in effect."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in RAY_ENVIRONMENT}


def startup_fields(artifact: str | Path, config: ClusterConfig, address: str, seconds: float) -> dict:
    """The cluster's start-up summary (server/logs.py's `startup` event; the replicas' model
    facts stay on the replicas, whose artifact this machine may not hold)."""
    s = config.server
    scale = str(config.replicas) if config.autoscale is None else f"{config.autoscale[0]}..{config.autoscale[1]}"
    return {
        "artifact": str(artifact),
        "model": s.model_name or "the artifact's",
        "proposer": s.proposer or "the artifact's",
        "replicas": scale,
        "slots": config.slots,
        "replica_queue": config.replica_queue,
        "max_queue": config.queue,
        "listen": address,
        "api_key": s.api_key is not None,
        "cors_origins": ",".join(s.cors_origins) or "none",
        "deploy_seconds": round(seconds, 2),
    }


def serve_cluster(
    artifact: str | Path, config: ClusterConfig, log_level: str = "info", log_format: str = "text"
) -> None:
    """Start (or join: config.ray_address) a Ray cluster, deploy the replicas, serve HTTP from this
    process (front.py) until SIGINT/SIGTERM, then drain: new requests get 503, running ones may
    finish for drain_seconds, what still runs then is cut with an error (never a clean short answer).
    Logs (server/logs.py) in `log_format` at `log_level`: the start-up summary, then one `request`
    line per finished request as its replica reported it (with the replica's id)."""
    import ray

    configure(log_format, log_level)
    warning = config.server.exposure_warning()
    if warning:
        print(warning, file=sys.stderr)
    sock = listen(config.server.host, config.server.port)  # before Ray starts: a busy port fails at once
    if config.ray_address is None:  # a cluster this command starts (a joined one has its own settings)
        ray_environment()
    try:
        ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        sock.close()
        raise ClusterError(
            f"cannot start or join Ray at {config.ray_address or 'a new local cluster'}: {exc}"
        ) from None
    drained, front = True, None  # drained: nothing left running that Serve's own shutdown should wait for
    try:
        serve.start(proxy_location="Disabled")  # no Ray HTTP proxy: this process is the front
        try:
            started = time.monotonic()
            handle = deploy(artifact, config, route_prefix=None)
            cors = config.server.cors_origins
            front = Front(relay(handle, config, config.name), sock, log_level, cors_origins=cors, own_logging=True)
            front.start()
            log.info(
                "startup", extra={"fields": startup_fields(artifact, config, front.address, time.monotonic() - started)}
            )
            scale = (
                f"{config.replicas} replicas"
                if config.autoscale is None
                else f"{config.autoscale[0]}..{config.autoscale[1]} replicas (autoscaling)"
            )
            print(f"serving {artifact} on http://{front.address}/v1 with {scale}", file=sys.stderr)
            signals = threading.Semaphore(0)
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: signals.release())
            signals.acquire()
            front.begin_drain()
            drained = drain(config, signals)
        except BaseException:  # a failed deployment or front, an interrupt before the signals are ours
            if front is not None:
                front.stop()
                front = None
            if config.ray_address is not None:  # a joined cluster keeps running: the application goes with us
                serve.delete(config.name)
            raise
    finally:
        if front is not None:
            front.stop()
        sock.close()
        if config.ray_address is None and drained:  # the cluster this command started, idle
            serve.shutdown()
        ray.shutdown()
