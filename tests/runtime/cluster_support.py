"""Helpers of the cluster tests (no tests here; modules import the fixture as `fixture_cluster`):
a local Ray cluster with Serve's proxy on a free port, deployments of tiny artifacts (behind an
HTTP front in this process, as `serve --replicas` runs them, or behind Ray's proxy), each
replica's own /metrics, and replica actors by id."""

from __future__ import annotations

import http.client
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specexport_runtime.cluster.config import ClusterConfig, LoadOptions
from specexport_runtime.cluster.deployment import (
    REPLICA_DEPLOYMENT,
    deploy,
    relay,
    running_replicas,  # noqa: F401 (the tests' import)
)
from specexport_runtime.cluster.front import Front, listen
from specexport_runtime.cluster.replica import REPLICA_HEADER
from specexport_runtime.server.config import ServerConfig

WAVE = 4  # concurrent /metrics requests per try of replica_metrics
LOGICAL_CPUS = 4  # Ray's placement count: 2 replicas + the Serve actors fit whatever the host's cores
FRONTS: list[Front] = []  # the fronts this module's tests started (stopped with the cluster)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", name="cluster")
def fixture_cluster():
    """A local Ray cluster with Serve's proxy on 127.0.0.1:<port>; yields the port."""
    import ray
    from ray import serve

    from specexport_runtime.cluster.deployment import ray_environment

    port = free_port()
    ray_environment()  # the Ray settings `serve --replicas` starts its cluster with
    ray.init(num_cpus=LOGICAL_CPUS, include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    for front in FRONTS:
        front.stop()
    FRONTS.clear()
    serve.shutdown()
    ray.shutdown()


def config(
    replicas: int | None = 2,
    max_queue: int = 32,
    keys: tuple[bytes, ...] | None = None,
    max_batch: int = 1,
    api_key: str | None = None,
    **kwargs,
):
    return ClusterConfig(
        server=ServerConfig(max_queue=max_queue, max_batch=max_batch, api_key=api_key),
        load=LoadOptions(threads=1, trusted_keys=keys),
        replicas=replicas,
        replica_cpus=1,
        **kwargs,
    )


def deploy_at(artifact, cfg: ClusterConfig, route: str | None = None) -> int | None:
    """Deploy `artifact` under cfg.name. route None (what `serve --replicas` runs): the replicas
    alone, behind an HTTP front in this process: returns the front's port. A route:
    deployment() behind Ray's proxy at that route (the `cluster` fixture's port): returns None."""
    deploy(artifact, cfg, route_prefix=route)
    return None if route is not None else front_for(cfg)


def front_for(cfg: ClusterConfig) -> int:
    """An HTTP front in this process relaying to cfg.name's replicas; returns its port."""
    from ray import serve

    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=cfg.name)
    cors = cfg.server.cors_origins
    front = Front(relay(handle, cfg, cfg.name), listen("127.0.0.1", 0), log_level="warning", cors_origins=cors)
    front.start()
    FRONTS.append(front)
    return front.port


def replica_metrics(port: int, want: int, tries: int = 200, key: str | None = None) -> dict[str, bytes]:
    """{replica id: its /metrics text}: GET /metrics until `want` replicas have answered (the
    router picks one per request); key: the API key, when the deployment has one."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}

    def one(_) -> tuple[str, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", "/metrics", headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            assert resp.status == 200, body
            return resp.getheader(REPLICA_HEADER.decode()), body
        finally:
            conn.close()

    seen: dict[str, bytes] = {}
    # WAVE requests at a time: an idle router may keep choosing the replica that answers its
    # queue-length probe first (a loaded host); requests in flight make it spread them
    with ThreadPoolExecutor(WAVE) as pool:
        for _ in range(0, tries, WAVE):
            seen.update(pool.map(one, range(WAVE)))
            if len(seen) >= want:
                return seen
    raise AssertionError(f"only replicas {sorted(seen)} answered /metrics in {tries} tries")


def kill_replica(replica_id: str) -> None:
    """Kill the Serve replica actor `replica_id` at once (ray.kill: its worker process is
    terminated, the requests it runs fail mid-way, Serve starts a replacement)."""
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].endswith(f"#{replica_id}"):
            ray.kill(ray.get_actor(entry["name"], namespace=entry["namespace"]), no_restart=True)
            return
    raise AssertionError(f"no named actor for replica {replica_id}")


def wait_until(predicate, timeout: float, what: str, every: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
