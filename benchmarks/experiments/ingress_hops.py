"""Where the cluster's per-request time goes: Ray Serve's proxy + the ingress deployment (what
cluster.deployment() composes), against the same relay (cluster.ingress.Relay) in a plain uvicorn
process outside Ray (what `serve --replicas` runs: cluster/front.py).

    python benchmarks/experiments/ingress_hops.py ARTIFACT [--pairs 150] [--completions 48]

One host, one local Ray cluster (started with deployment.RAY_ENVIRONMENT), three entry points side
by side: a single `specexport-runtime serve` process; the application deployment() composes
(HTTP -> Ray's proxy -> Ingress deployment -> replica); and a second replica deployment with no
HTTP route whose Relay runs in its own uvicorn process (HTTP -> Relay -> replica, the same gRPC
handle call). Requests go one at a time to all three in alternating order; reported: medians of
each cluster entry's time minus the single server's, for GET /health, GET /v1/models (a replica
answers, no model work) and the time to the first text of a streamed 8-token greedy completion.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "benchmarks"))

from specexport.bench import harness  # noqa: E402

OWN_APP = "own-ingress"


def own_ingress(port: int, app: str) -> None:
    """The Relay of `app`'s replica deployment on 127.0.0.1:port (a subprocess of this script)."""
    import ray
    import uvicorn
    from ray import serve

    from specexport_runtime.cluster.deployment import REPLICA_DEPLOYMENT
    from specexport_runtime.cluster.ingress import Relay

    ray.init(address="auto", log_to_driver=False)
    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=app)
    uvicorn.run(Relay(handle, 16, 1 << 20), host="127.0.0.1", port=port, log_level="warning")


def parser():
    parser = harness.script_parser(__doc__)
    parser.add_argument("artifact", help="artifact folder")
    parser.add_argument("--pairs", type=int, default=150, help="GET requests to each entry per path (default 150)")
    parser.add_argument("--completions", type=int, default=48, help="streamed completions to each (default 48)")
    parser.add_argument(
        "--own-ingress",
        nargs=2,
        metavar=("PORT", "APP"),
        help="internal: run only the own-process ingress of APP's replicas on PORT (the script starts it so)",
    )
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.own_ingress:
        own_ingress(int(args.own_ingress[0]), args.own_ingress[1])
        return 0
    import cluster_overhead as co
    import ray
    from ray import serve

    from specexport_runtime.cluster.config import ClusterConfig, LoadOptions
    from specexport_runtime.cluster.deployment import REPLICA_DEPLOYMENT, deploy, ray_environment
    from specexport_runtime.cluster.replica import SpecReplica
    from specexport_runtime.server.config import ServerConfig

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    single, proxied, own = co.free_port(), co.free_port(), co.free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "runtime")])}
    cmd = [sys.executable, "-m", "specexport_runtime.cli", "serve", args.artifact, "--port", str(single)]
    procs = [subprocess.Popen(cmd + ["--threads", "1", "--model-name", co.MODEL, "--log-level", "warning"], env=env)]
    try:
        meta["ray_environment"] = ray_environment()
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": proxied})
        config = ClusterConfig(
            server=ServerConfig(max_queue=16, model_name=co.MODEL), load=LoadOptions(threads=1), replica_cpus=1
        )
        deploy(args.artifact, config)
        replica = serve.deployment(SpecReplica, name=REPLICA_DEPLOYMENT, **config.ray_options())
        serve.run(replica.bind(os.path.abspath(args.artifact), config), name=OWN_APP, route_prefix=None)
        procs.append(subprocess.Popen([sys.executable, __file__, args.artifact, "--own-ingress", str(own), OWN_APP]))
        for port in (single, proxied, own):
            co.wait_ready(port)
            for _ in range(20):
                co.get(port, "/v1/models")
        extra: dict[str, dict[str, float]] = {}
        for name, n, measure in (  # measure(port, i) -> seconds
            ("health_ms", args.pairs, lambda port, i: co.get(port, "/health")),
            ("models_ms", args.pairs, lambda port, i: co.get(port, "/v1/models")),
            ("ttft_ms", args.completions, lambda port, i: co.completion(port, co.PROMPTS[i % 4], 8, True)[1]),
        ):
            diffs: dict[int, list[float]] = {proxied: [], own: []}
            for i in range(n):
                order = (single, proxied, own) if i % 2 == 0 else (own, proxied, single)
                got = {port: measure(port, i) for port in order}
                for port in (proxied, own):
                    diffs[port].append(1000 * (got[port] - got[single]))
            extra[name] = {"proxy_ingress": statistics.median(diffs[proxied]), "own": statistics.median(diffs[own])}
    finally:
        for process in procs:
            process.terminate()
            process.wait(60)
        serve.shutdown()
        ray.shutdown()
    print(harness.header(meta))
    for name, value in extra.items():
        proxy, own_process = value["proxy_ingress"], value["own"]
        print(f"{name:10} proxy + ingress deployment {proxy:+6.1f}   own-process ingress {own_process:+6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
