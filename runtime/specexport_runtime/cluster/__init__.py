"""Serving one artifact on a Ray Serve cluster: replicas, autoscaling, failover (docs/serving.md).

The cluster extra (`pip install ./runtime[cluster]`: ray[serve] and the serve extra) is imported by deployment.py and
ingress.py only when used: importing this package costs nothing and `missing_cluster_extra()`
says whether it can run.

Modules: config (ClusterConfig, LoadOptions), replica (SpecReplica: loads and verifies the
artifact, runs the server's app), ingress (Relay: the HTTP ingress that forwards to replicas and
answers 429 / 503 / mid-stream errors), deployment (the Ray Serve Application, deploy, and the
`serve --replicas/--autoscale` loop).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import SpecExportError

CLUSTER_EXTRA = "pip install ./runtime[cluster]"
SERVER_PACKAGES = ("starlette", "uvicorn", "prometheus_client")  # the serve extra's, which replicas import


def missing_cluster_extra() -> str | None:
    """A one-line error naming what is missing for a cluster, or None when ray[serve] and the
    server's packages (each replica runs the server's app) are installed."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        return f"a cluster needs the cluster extra (ray[serve] not installed): {CLUSTER_EXTRA}"
    missing = [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        return f"a cluster needs the cluster extra ({', '.join(missing)} not installed): {CLUSTER_EXTRA}"
    return None


class ClusterExtraMissing(SpecExportError):
    """ray[serve] is not installed."""


def deployment(artifact: str | Path, config=None):
    """A Ray Serve Application serving `artifact` (deployment.deployment; needs ray[serve])."""
    missing = missing_cluster_extra()
    if missing:
        raise ClusterExtraMissing(missing)
    from .deployment import deployment as build

    return build(artifact, config)
