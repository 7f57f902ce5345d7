"""Cluster settings (`serve --replicas/--autoscale`), checked once before anything starts.

One ClusterConfig holds what Ray Serve needs (replica count or autoscaling bounds, where Ray
runs) next to the ServerConfig every replica's app runs with. Invariants:
- exactly one of `replicas` (a fixed count) and `autoscale` ((min, max) replicas) is set;
- `server.max_queue` is the cluster-wide queue: requests waiting at the ingress for a replica
  slot (Ray Serve's max_queued_requests); one more is answered 429;
- each replica holds at most `server.max_batch` running + `replica_queue` waiting requests
  (max_ongoing_requests); Ray routes a request to the replica with the fewest of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..constants import ONNXRUNTIME
from ..errors import InvalidArgument
from ..loading import check_backend
from ..server.config import ServerConfig

MAX_REPLICAS = 1024
APP_NAME = "specexport"  # Ray Serve application name of `serve --replicas/--autoscale`
SHUTDOWN_SLACK = 5.0  # seconds past a drain for a replica's last round and its stop


@dataclass(frozen=True)
class LoadOptions:
    """How each replica opens the artifact (api.load's arguments, minus the artifact path).

    trusted_keys holds the keys' PEM bytes, not paths: a replica on another machine checks the
    signature with the keys the operator named on this one."""

    provider: str = "cpu"
    threads: int | None = None  # ONNX Runtime intra-op threads per replica (None: all cores)
    verify: bool = True
    shared_pool: bool = True
    trusted_keys: tuple[bytes, ...] | None = None
    backend: str = ONNXRUNTIME  # api.load's backend (constants.BACKENDS)
    suffix_factor: float | None = None
    suffix_max_spec: int | None = None
    prefix_cache_bytes: int | None = None  # each replica's prefix pool bound (None: its default; prefix_cache.py)

    def __post_init__(self) -> None:
        if self.provider not in ("cpu", "cuda", "tensorrt"):
            raise InvalidArgument(f"provider must be cpu, cuda or tensorrt, got {self.provider!r}")
        check_backend(self.backend, provider=self.provider, threads=self.threads)
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise InvalidArgument(f"threads must be an integer >= 1 or None, got {self.threads!r}")
        if self.trusted_keys is not None and not self.trusted_keys:
            raise InvalidArgument("trusted_keys is empty: give at least one public key, or None to skip the check")


@dataclass(frozen=True)
class ClusterConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    load: LoadOptions = field(default_factory=LoadOptions)
    replicas: int | None = 1  # a fixed replica count (None when autoscale is set)
    autoscale: tuple[int, int] | None = None  # (min_replicas, max_replicas)
    target_ongoing: float | None = None  # autoscaling target of requests per replica (None: server.max_batch)
    upscale_delay: float = 5.0  # seconds the load must stay above target before a replica is added
    downscale_delay: float = 30.0  # seconds it must stay below before one is removed
    ray_address: str | None = None  # None: start a local Ray; "auto" or host:port: join that cluster
    replica_cpus: float = 1.0  # logical CPUs Ray reserves for each replica (placement only)
    replica_queue: int = 1  # requests that may wait at a replica (0: only free slots; more hides the hand-off)
    health_check_period: float = 5.0  # seconds between Ray's health checks of each replica
    name: str = APP_NAME

    def __post_init__(self) -> None:
        if not isinstance(self.server, ServerConfig):
            raise InvalidArgument(f"server must be a ServerConfig, got {type(self.server).__name__}")
        check_backend(self.load.backend, batch=self.server.max_batch > 1)  # each replica's slots
        if self.server.max_queue < 1:
            raise InvalidArgument(
                f"max_queue must be >= 1 on a cluster (requests waiting for a slot), got {self.server.max_queue}"
            )
        if (self.replicas is None) == (self.autoscale is None):
            raise InvalidArgument("give exactly one of replicas (a fixed count) and autoscale (min, max)")
        if self.replicas is not None and not _count(self.replicas, 1):
            raise InvalidArgument(f"replicas must be an integer in 1..{MAX_REPLICAS}, got {self.replicas!r}")
        if self.autoscale is not None:
            pair = self.autoscale
            if not (isinstance(pair, tuple) and len(pair) == 2 and _count(pair[0], 0) and _count(pair[1], 1)):
                raise InvalidArgument(
                    f"autoscale must be (min, max) replicas with 0 <= min <= max, 1 <= max <= {MAX_REPLICAS},"
                    f" got {pair!r}"
                )
            if pair[0] > pair[1]:
                raise InvalidArgument(f"autoscale min {pair[0]} is larger than max {pair[1]}")
        for name in ("upscale_delay", "downscale_delay", "health_check_period", "replica_cpus"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"{name} must be a finite number >= 0, got {value!r}")
        if (
            not isinstance(self.replica_queue, int)
            or isinstance(self.replica_queue, bool)
            or not 0 <= self.replica_queue <= 64
        ):
            raise InvalidArgument(f"replica_queue must be an integer in 0..64, got {self.replica_queue!r}")
        if self.health_check_period <= 0:
            raise InvalidArgument(f"health_check_period must be > 0 seconds, got {self.health_check_period!r}")
        if self.target_ongoing is not None and (
            not isinstance(self.target_ongoing, (int, float)) or not 0 < self.target_ongoing <= 10_000
        ):
            raise InvalidArgument(f"target_ongoing must be a number in (0, 10000], got {self.target_ongoing!r}")
        if self.ray_address is not None and not self.ray_address.strip():
            raise InvalidArgument("ray_address must be 'auto', HOST:PORT or ray://HOST:PORT, got an empty string")
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise InvalidArgument(f"name must be letters, digits, '-' and '_', got {self.name!r}")

    @property
    def queue(self) -> int:
        """Requests that may wait cluster-wide for a replica slot (Ray Serve's max_queued_requests)."""
        return self.server.max_queue

    @property
    def slots(self) -> int:
        """Requests one replica runs at once."""
        return self.server.max_batch

    @property
    def per_replica(self) -> int:
        """Requests Ray hands one replica at once, running and waiting (max_ongoing_requests)."""
        return self.slots + self.replica_queue

    @property
    def replica_server(self) -> ServerConfig:
        """What each replica's app runs with: the server's settings, with a local queue of
        `replica_queue` plus one batch of headroom (Ray sends a replica at most `per_replica`
        requests; the headroom absorbs the moment between one request's last chunk and its slot
        being free), and no CORS: the front answers it (ingress.front_app), and a second
        Access-Control-Allow-Origin would make browsers refuse the answer."""
        from dataclasses import replace

        return replace(self.server, max_queue=self.replica_queue + self.server.max_batch, cors_origins=())

    @property
    def shutdown_grace(self) -> float:
        """Seconds a replica that Ray stops (downscaling, a redeploy, the app's deletion) waits for
        its requests before Ray kills it: the request timeout, which ends every request, and the
        drain's seconds on top. So removing a replica never cuts a request; `serve` bounds its own
        shutdown by drain_seconds instead (deployment.serve_cluster)."""
        return self.server.request_timeout + self.server.drain_seconds + SHUTDOWN_SLACK

    @property
    def min_replicas(self) -> int:
        """The fewest replicas meant to run: the fixed count, or autoscaling's minimum (0: scale to zero)."""
        return self.replicas if self.autoscale is None else self.autoscale[0]

    def ray_options(self) -> dict:
        """serve.deployment options of the replica deployment."""
        options: dict = {
            "max_ongoing_requests": self.per_replica,
            "max_queued_requests": self.queue,
            "health_check_period_s": self.health_check_period,
            "ray_actor_options": {"num_cpus": self.replica_cpus},
            "max_constructor_retry_count": 1,  # a replica that refuses the artifact fails the deployment
            "graceful_shutdown_timeout_s": self.shutdown_grace,
        }
        if self.autoscale is None:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.autoscale[0],
                "max_replicas": self.autoscale[1],
                "initial_replicas": max(1, self.autoscale[0]),
                "target_ongoing_requests": self.target_ongoing or self.slots,
                "upscale_delay_s": self.upscale_delay,
                "downscale_delay_s": self.downscale_delay,
            }
        return options


def _count(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_REPLICAS


def parse_autoscale(text: str) -> tuple[int, int]:
    """'MIN:MAX' -> (min, max); InvalidArgument naming the value otherwise."""
    low, sep, high = text.partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise InvalidArgument(f"--autoscale expects MIN:MAX replicas (e.g. 1:4), got {text!r}")
    return int(low), int(high)
