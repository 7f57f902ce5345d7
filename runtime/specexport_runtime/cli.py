"""`specexport-runtime` (also reached as `specexport generate`): generate from an artifact.

argparse, not click: the runtime keeps its dependencies to numpy, onnxruntime, tokenizers.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

from .errors import SpecExportError
from .manifest import SPECULATIVE_PROPOSERS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specexport-runtime", description="Run a specexport artifact.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with (or without) speculative decoding",
                         description="Generate text from an artifact; prints the text, then one summary line.")
    add_generate_arguments(gen)
    return parser


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("artifact", help="artifact folder written by `specexport build`")
    gen.add_argument("--prompt", required=True, help="prompt text (with --chat: the user message)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the artifact's chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("--stream", action="store_true", help="print text pieces as tokens are accepted")
    gen.add_argument("--no-speculation", action="store_true", help="target-only decoding (the baseline)")
    gen.add_argument("--proposer", choices=SPECULATIVE_PROPOSERS, default=None,
                     help="draft model, n-gram prompt lookup, hybrid (lookup when the last 3 tokens occurred"
                          " before, else the draft model), eagle (an EAGLE-3 head), or suffix (the most frequent"
                          " continuation of the longest earlier match, in the request and in earlier answers)"
                          " (default: the artifact's)")
    gen.add_argument("--gamma", type=int, default=None, help="fixed draft length (default: adaptive)")
    gen.add_argument("--min-draft-prob", type=float, default=0.0,
                     help="end a draft round early when the draft's top probability is below this (0 = never)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="maximum tokens to generate (default 128)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--provider", choices=["cpu", "cuda", "tensorrt"], default="cpu",
                     help="ONNX Runtime execution provider")
    gen.add_argument("--threads", type=int, default=None, help="intra-op threads (default: all cores)")
    gen.add_argument("--domain", default=None, help="calibration profile to start gamma from")
    gen.add_argument("--no-verify", action="store_true", help="skip the checksum verification at load")
    gen.add_argument("--no-shared-pool", action="store_true",
                     help="give target and draft their own CPU thread pools (default: one shared pool)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run_generate(args: argparse.Namespace) -> int:
    from .api import load

    gen = load(args.artifact, provider=args.provider, threads=args.threads, verify=not args.no_verify,
               shared_pool=not args.no_shared_pool)
    kwargs = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, gamma=args.gamma, proposer=args.proposer, stop=tuple(args.stop),
        speculative=not args.no_speculation, domain=args.domain, min_draft_prob=args.min_draft_prob,
    )
    messages = None
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    if args.stream and not args.json:
        pieces = gen.chat(messages, stream=True, **kwargs) if messages else gen.stream(args.prompt, **kwargs)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        stats, text, reason = gen.last_stats, None, None
    else:
        result = gen.chat(messages, **kwargs) if messages else gen.generate(args.prompt, **kwargs)
        stats, text, reason = result.stats, result.text, result.finish_reason
        if args.json:
            print(json.dumps({"text": text, "token_ids": result.token_ids, "finish_reason": reason,
                              "stats": {k: v for k, v in stats.to_dict().items() if k != "token_times"}}))
            return 0
        print(text)
    mode = "target-only" if args.no_speculation else f"proposer={args.proposer or gen.default_proposer}"
    print(
        f"[{mode}] {stats.new_tokens} new tokens, {stats.tokens_per_second:.1f} tok/s, "
        f"mean accepted length {stats.mean_accepted_length:.2f}, acceptance {stats.acceptance_rate:.1%}"
        + (f", finish {reason}" if reason else ""),
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run_generate(args)
    except SpecExportError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
