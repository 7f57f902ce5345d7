"""What the measuring scripts share: the run's record (machine, command, date, versions,
settings), a report's first lines, JSON output, the shared command-line options and the one-line
error exit.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from specexport_runtime.errors import SpecExportError

from ..errors import HarnessError
from . import machine

# packages whose versions a run records when installed (looked up without importing them)
VERSIONS = ("specexport", "specexport-runtime", "onnxruntime", "onnxruntime-genai", "numpy", "torch", "transformers")


def run_metadata(argv: Sequence[str] | None = None, **settings: Any) -> dict:
    """{"machine": machine.describe(), "command": the exact command line, "date", "python",
    "versions": installed VERSIONS, "settings"}; argv defaults to sys.argv (script first)."""
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "machine": machine.describe(),
        "command": shlex.join(["python", *(sys.argv if argv is None else argv)]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "versions": versions,
        "settings": {
            k: v if isinstance(v, (int, float, bool, str, type(None))) else str(v) for k, v in settings.items()
        },
    }


def header(meta: dict) -> str:
    """One line naming the machine and the command of a run_metadata() record."""
    m = meta["machine"]
    return f"machine: {m['cpu']} ({m['cpu_count']} logical cores, {m['platform']}); command: {meta['command']}"


class _WithMemoryNotes(Protocol):  # harness.Run
    def memory_notes(self) -> list[str]: ...


def preamble(meta: dict, run: _WithMemoryNotes | None, settings: str) -> str:
    """A report's first lines: header(meta), the run's settings in words, and one 'memory: ...'
    line per run.memory_notes() entry."""
    notes = run.memory_notes() if run is not None else []
    return "\n".join([header(meta), settings, *(f"memory: {note}" for note in notes)])


def write_json(path: str | Path, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first paragraph as description, the rest as epilog."""
    first, _, rest = doc.strip().partition("\n\n")
    return argparse.ArgumentParser(description=first, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_run_options(
    ap: argparse.ArgumentParser,
    prompts: str = "code",
    limit: int = 3,
    max_new_tokens: int | None = 128,
    repeats: int | None = 1,
    threads: int = 2,
) -> None:
    """The options the measuring scripts share: --prompts --limit --max-new-tokens (None: each
    prompt's own) --repeats (left out with repeats=None: a script that times nothing) --threads
    --json; check_run_options() validates them."""
    ap.add_argument(
        "--prompts",
        default=prompts,
        help=f"comma-separated calibration domains, 'all', or JSONL/text prompt files (default {prompts})",
    )
    ap.add_argument("--limit", type=int, default=limit, help=f"prompts per domain (default {limit})")
    own = "each prompt's own max_new_tokens" if max_new_tokens is None else max_new_tokens
    ap.add_argument(
        "--max-new-tokens", type=int, default=max_new_tokens, help=f"new tokens per generation at most (default {own})"
    )
    if repeats is not None:
        ap.add_argument(
            "--repeats",
            type=int,
            default=repeats,
            help=f"measurements of every prompt and method, interleaved (default {repeats})",
        )
    ap.add_argument(
        "--threads", type=int, default=threads, help=f"intra-op threads of every engine (default {threads})"
    )
    ap.add_argument(
        "--json", default=None, metavar="OUT", help="write the machine, command, settings and results as JSON here"
    )


def int_list(text: str, option: str, minimum: int = 1) -> list[int]:
    """A comma list of integers >= minimum, in the order given; HarnessError naming the option
    otherwise (a script's bad input ends in one line, cli())."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        raise HarnessError(f"{option} takes a comma list of integers >= {minimum}, got {text!r}")
    return values


def parse_args(ap: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """ap.parse_args(argv), the shared options checked (check_run_options)."""
    args = ap.parse_args(argv)
    check_run_options(args)
    return args


def check_run_options(args: argparse.Namespace) -> None:
    """HarnessError naming the first of the shared options below 1."""
    for name in ("limit", "max_new_tokens", "repeats", "threads"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise HarnessError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run a script's main; a SpecExportError (bad input) ends it with one line 'error: ...', exit 2."""
    try:
        return int(main(argv) or 0)
    except SpecExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
