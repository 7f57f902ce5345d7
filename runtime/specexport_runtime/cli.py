"""`specexport-runtime` (also reached as `specexport generate` / `specexport serve`): generate from an
artifact, or serve it over an OpenAI-compatible HTTP API.

argparse, not click: the runtime keeps its dependencies to numpy, onnxruntime, tokenizers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from . import registry
from .constants import BACKENDS, ONNXRUNTIME
from .errors import SpecExportError
from .server.config import add_prefix_arguments
from .server.options import add_cluster_arguments, add_http_arguments, http_settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specexport-runtime", description="Run a specexport artifact.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="generate text with (or without) speculative decoding",
        description="Generate text from an artifact; prints the text, then one summary line.",
    )
    add_generate_arguments(gen)
    srv = sub.add_parser(
        "serve",
        help="serve an artifact over an OpenAI-compatible HTTP API (needs the serve extra)",
        description="Serve an artifact over HTTP: /v1/chat/completions, /v1/completions, /v1/models,"
        " /health, /metrics (Prometheus). One generation at a time; the others wait in a"
        " bounded queue. Needs `pip install ./runtime[serve]`. With --replicas or --autoscale, on a"
        " Ray Serve cluster (`pip install ./runtime[cluster]`). See docs/serving.md.",
    )
    add_serve_arguments(srv)
    unp = sub.add_parser(
        "unpack",
        help="install a .spx package atomically (a symlink switched to the new version)",
        description="Check a .spx package's members (regular files inside the artifact only), extract"
        " it next to DIR, verify its signature (--trusted-key) and checksums, then switch"
        " DIR (a symlink into DIR.versions/) to it atomically. docs/artifact.md.",
    )
    unp.add_argument("package", help="the .spx file written by `specexport pack`")
    unp.add_argument("--into", required=True, help="the install path (a symlink this command manages)")
    unp.add_argument("--keep", type=int, default=1, help="earlier versions kept for rollback (default 1)")
    unp.add_argument(
        "--trusted-key",
        action="append",
        default=None,
        metavar="PUBLIC_KEY",
        help="an ed25519 public key (PEM); repeatable: the package must be signed by one of them",
    )
    rb = sub.add_parser(
        "rollback",
        help="switch an unpacked install back to its previous version",
        description="Point DIR back at the newest version kept before the current one.",
    )
    rb.add_argument("into", help="the install path given to unpack --into")
    return parser


NO_PREPACK_HELP = (  # generate and serve
    "CPU: do not repack the weights per ONNX Runtime session; the weights files are mapped and shared"
    " (about half the resident memory, about 0.75x decode speed; the rows of a verify call are then equal"
    " to one-row calls numerically, not bit for bit; docs/trees.md)"
)


def add_serve_arguments(srv: argparse.ArgumentParser) -> None:
    srv.add_argument("artifact", help="artifact folder written by `specexport build`")
    srv.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; another address without --api-key"
        " prints a warning)",
    )
    srv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("SPECEXPORT_API_KEY") or None,
        help="require `Authorization: Bearer KEY` on /v1/* and /metrics (default: the SPECEXPORT_API_KEY"
        " environment variable; unset = no key). /health stays open",
    )
    srv.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait behind the running one; one more gets 429 with Retry-After (default 16)",
    )
    srv.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="requests generating at once, in one batched target call per round (docs/batching.md);"
        " > 1 needs an artifact built with --max-batch of at least that many (default: the artifact's"
        " max_batch, 1 for an artifact without a batch graph or with --backend tensorrt)",
    )
    srv.add_argument(
        "--proposer",
        choices=registry.names(),
        default=None,
        help="proposer of requests that name none in their `proposer` field ('none': target only;"
        " default: the artifact's)",
    )
    srv.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores)")
    srv.add_argument("--no-prepack", action="store_true", help=NO_PREPACK_HELP)
    srv.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest request body accepted; larger ones get 413 (default 1048576)",
    )
    srv.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds from arrival: a request still queued then gets 503, a running one is cut after its"
        " round with finish_reason 'length' (default 600)",
    )
    srv.add_argument(
        "--drain-seconds",
        type=float,
        default=10.0,
        help="on SIGTERM: new and queued requests get 503 at once; the running one may go on this long,"
        " then it is cut with a final chunk, and the process exits (default 10)",
    )
    srv.add_argument(
        "--stall-seconds",
        type=float,
        default=30.0,
        help="a streaming client that reads nothing for this long is treated as gone (default 30)",
    )
    srv.add_argument(
        "--model-name", default=None, help="model id clients send and /v1/models lists (default: the artifact's name)"
    )
    add_prefix_arguments(srv)
    srv.add_argument(
        "--provider", choices=["cpu", "cuda", "tensorrt"], default="cpu", help="ONNX Runtime execution provider"
    )
    add_backend_argument(srv)
    srv.add_argument(
        "--no-shared-pool",
        action="store_true",
        help="give target and draft their own CPU thread pools (default: one shared pool)",
    )
    srv.add_argument("--no-verify", action="store_true", help="skip the checksum verification at load")
    srv.add_argument(
        "--trusted-key",
        action="append",
        default=None,
        metavar="PUBLIC_KEY",
        help="an ed25519 public key (PEM); repeatable: the artifact must be signed by one of them"
        " (specexport sign; needs pip install './runtime[sign]')",
    )
    add_http_arguments(srv)
    add_suffix_arguments(srv)
    add_cluster_arguments(srv)


def run_serve(args: argparse.Namespace) -> int:
    from .server import ServeExtraMissing, missing_serve_extra

    missing = missing_serve_extra()
    if missing:
        raise ServeExtraMissing(missing)
    from dataclasses import replace

    from .api import load
    from .manifest import read_manifest
    from .server.config import ServerConfig, prefix_overrides
    from .server.run import serve
    from .slots import too_few_slots

    config = ServerConfig(
        max_batch=1 if args.max_batch is None else args.max_batch,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        drain_seconds=args.drain_seconds,
        stall_seconds=args.stall_seconds,
        model_name=args.model_name,
        proposer=args.proposer,
        share_prefix_cache=args.share_prefix_cache,
        **http_settings(args),
    )  # checked before the slow load
    from .errors import InvalidArgument

    if args.replicas is not None or args.autoscale is not None:
        if args.no_prepack:
            raise InvalidArgument("--no-prepack applies to one server process; cluster replicas repack their weights")
        return run_cluster(args, config)
    if args.ray_address is not None:
        raise InvalidArgument("--ray-address needs --replicas N or --autoscale MIN:MAX")
    has = read_manifest(args.artifact).target.max_batch  # read again, verified, by load
    if config.max_batch > has:  # before the slow load, naming the rebuild
        raise too_few_slots(args.artifact, has, config.max_batch)
    if args.max_batch is None:  # the artifact's slots; the tensorrt backend runs batch-1 graphs
        config = replace(config, max_batch=has if args.backend == ONNXRUNTIME else 1)
    started = time.monotonic()
    gen = load(
        args.artifact,
        provider=args.provider,
        threads=args.threads,
        verify=not args.no_verify,
        shared_pool=not args.no_shared_pool,
        trusted_keys=args.trusted_key,
        config={**suffix_overrides(args), **prefix_overrides(args)},
        batch=config.max_batch > 1,
        prepack=not args.no_prepack,
        backend=args.backend,
    )
    serve(gen, config, args.log_level, args.log_format, time.monotonic() - started)
    return 0


def run_cluster(args: argparse.Namespace, server) -> int:
    """`serve --replicas/--autoscale`: the artifact on a Ray Serve cluster (cluster/deployment.py)."""
    from dataclasses import replace
    from pathlib import Path

    from .cluster import ClusterExtraMissing, missing_cluster_extra
    from .cluster.config import ClusterConfig, LoadOptions, parse_autoscale
    from .errors import InvalidArgument
    from .manifest import read_manifest
    from .package import SUFFIX, peek_manifest
    from .server.config import prefix_overrides

    missing = missing_cluster_extra()
    if missing:
        raise ClusterExtraMissing(missing)
    keys = None
    if args.trusted_key:
        try:
            keys = tuple(Path(k).read_bytes() for k in args.trusted_key)
        except OSError as exc:
            raise InvalidArgument(f"--trusted-key: cannot read {exc.filename!r}: {exc.strerror}") from None
    load = LoadOptions(
        provider=args.provider,
        threads=args.threads,
        verify=not args.no_verify,
        shared_pool=not args.no_shared_pool,
        trusted_keys=keys,
        backend=args.backend,
        suffix_factor=args.suffix_factor,
        suffix_max_spec=args.suffix_max_spec,
        **prefix_overrides(args),
    )
    autoscale = None if args.autoscale is None else parse_autoscale(args.autoscale)
    # no --max-batch: the artifact's slots (a .spx's manifest is read, not verified: every replica
    # verifies); the tensorrt backend runs batch-1 graphs
    if args.max_batch is None and args.backend == ONNXRUNTIME:
        path = Path(args.artifact)
        if not path.exists():
            raise InvalidArgument(
                f"{args.artifact!r} is not on this machine: give --max-batch (each replica's slots) to serve an"
                " artifact that only the worker nodes hold"
            )
        manifest = peek_manifest(path) if path.suffix == SUFFIX and path.is_file() else read_manifest(path)
        server = replace(server, max_batch=manifest.target.max_batch)
    config = ClusterConfig(
        server=server,
        load=load,
        replicas=args.replicas,
        autoscale=autoscale,
        target_ongoing=args.target_ongoing,
        upscale_delay=args.upscale_delay,
        downscale_delay=args.downscale_delay,
        ray_address=args.ray_address,
        replica_cpus=args.replica_cpus,
        replica_queue=args.replica_queue,
    )
    from .cluster.deployment import serve_cluster

    serve_cluster(args.artifact, config, log_level=args.log_level, log_format=args.log_format)
    return 0


def add_backend_argument(p: argparse.ArgumentParser) -> None:
    """api.load's backend (constants.BACKENDS)."""
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=ONNXRUNTIME,
        help="what runs the graphs: onnxruntime (default; on --provider) or tensorrt, the native TensorRT"
        " backend on engines built here with `python -m specexport_runtime.trt_build ARTIFACT` (needs"
        " './runtime[tensorrt]' and a CUDA GPU; batch-1 graphs and chains only: no --max-batch > 1, no"
        " --tree-nodes; --provider / --threads / --no-prepack keep their defaults; docs/gpu.md)",
    )


def add_suffix_arguments(p: argparse.ArgumentParser) -> None:
    """The suffix proposer's draft limit: min(max_spec, floor(factor x match length)) tokens."""
    p.add_argument(
        "--suffix-factor",
        type=float,
        default=None,
        help="suffix proposer: draft up to this many tokens per matched token, fixed (default: 1.0,"
        " scaled x0.5 / x1 / x2 by whichever measures fastest on this target: docs/proposers.md)",
    )
    p.add_argument(
        "--suffix-max-spec",
        type=int,
        default=None,
        help="suffix proposer: most tokens per draft, fixed (default: 16, tuned like --suffix-factor;"
        " one verify call holds at most 63)",
    )


def suffix_overrides(args: argparse.Namespace) -> dict:
    """{"suffix": a SuffixConfig} from --suffix-factor / --suffix-max-spec, with that limit fixed
    (no tuning); {} when neither is given (the default, whose limit the runtime tunes:
    suffix.LimitTuner)."""
    from .suffix import SuffixConfig

    suffix = SuffixConfig.fixed_limit(args.suffix_factor, args.suffix_max_spec)
    return {} if suffix is None else {"suffix": suffix}


def _proposer_help() -> str:
    return "; ".join(f"{name}: {registry.get(name).label}" for name in registry.speculative_names())


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("artifact", help="artifact folder written by `specexport build`")
    gen.add_argument("--prompt", required=True, help="prompt text (with --chat: the user message)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the artifact's chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("--stream", action="store_true", help="print text pieces as tokens are accepted")
    gen.add_argument("--no-speculation", action="store_true", help="target-only decoding (the baseline)")
    gen.add_argument(
        "--proposer",
        choices=registry.speculative_names(),
        default=None,
        help=f"{_proposer_help()} (default: the artifact's)",
    )
    gen.add_argument("--gamma", type=int, default=None, help="fixed draft length (default: adaptive)")
    gen.add_argument(
        "--min-draft-prob",
        type=float,
        default=0.0,
        help="end a draft round early when the draft's top probability is below this (0 = never)",
    )
    gen.add_argument(
        "--tree-nodes",
        type=int,
        default=None,
        help="suffix and EAGLE-3 drafts as trees of up to this many tokens, verified in one call (an artifact built"
        " with --tree-verify; docs/trees.md); 0 = chains; default: the calibrated size (calibration.json), else chains",
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="maximum tokens to generate (default 128)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--provider", choices=["cpu", "cuda", "tensorrt"], default="cpu", help="ONNX Runtime execution provider"
    )
    add_backend_argument(gen)
    gen.add_argument("--threads", type=int, default=None, help="intra-op threads (default: all cores)")
    gen.add_argument("--no-prepack", action="store_true", help=NO_PREPACK_HELP)
    gen.add_argument("--domain", default=None, help="calibration profile to start gamma from")
    gen.add_argument("--no-verify", action="store_true", help="skip the checksum verification at load")
    gen.add_argument(
        "--trusted-key",
        action="append",
        default=None,
        metavar="PUBLIC_KEY",
        help="an ed25519 public key (PEM); repeatable: the artifact must be signed by one of them"
        " (specexport sign; needs pip install './runtime[sign]')",
    )
    gen.add_argument(
        "--no-shared-pool",
        action="store_true",
        help="give target and draft their own CPU thread pools (default: one shared pool)",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_suffix_arguments(gen)


def run_generate(args: argparse.Namespace) -> int:
    from .api import load
    from .limits import check_room

    config = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        gamma=args.gamma,
        proposer=args.proposer,
        stop=tuple(args.stop),
        speculative=not args.no_speculation,
        domain=args.domain,
        min_draft_prob=args.min_draft_prob,
        tree_nodes=args.tree_nodes,
        **suffix_overrides(args),
    )
    gen = load(
        args.artifact,
        provider=args.provider,
        threads=args.threads,
        verify=not args.no_verify,
        shared_pool=not args.no_shared_pool,
        trusted_keys=args.trusted_key,
        config=config,
        prepack=not args.no_prepack,
        backend=args.backend,
    )
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        ids = gen.codec.encode_chat(messages)
    else:
        ids = gen.codec.encode(args.prompt)
    check_room("--max-new-tokens", args.max_new_tokens, len(ids), gen.manifest.max_context)  # as the server's 400
    run = gen.events(ids)
    if args.stream and not args.json:
        for piece in run.pieces():
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        stats, reason = run.stats, None
    else:
        result = run.collect()
        stats, reason = result.stats, result.finish_reason
        if args.json:
            print(
                json.dumps(
                    {
                        "text": result.text,
                        "token_ids": result.token_ids,
                        "finish_reason": reason,
                        "stats": {k: v for k, v in stats.to_dict().items() if k != "token_times"},
                    }
                )
            )
            return 0
        print(result.text)
    mode = "target-only" if not gen.config.speculating else f"proposer={gen.config.proposer}"
    print(
        f"[{mode}] {stats.new_tokens} new tokens, {stats.tokens_per_second:.1f} tok/s, "
        f"mean accepted length {stats.mean_accepted_length:.2f}, acceptance {stats.acceptance_rate:.1%}"
        + (f", tree_nodes {run.config.tree_nodes} ({run.tree_policy})" if run.tree_policy != "chains" else "")
        + (f", finish {reason}" if reason else ""),
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "unpack":
            from .package import unpack

            print(f"installed {unpack(args.package, args.into, args.trusted_key, args.keep)} at {args.into}")
            return 0
        if args.command == "rollback":
            from .package import rollback

            print(f"{args.into} -> {rollback(args.into)}")
            return 0
        return run_serve(args) if args.command == "serve" else run_generate(args)
    except SpecExportError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
