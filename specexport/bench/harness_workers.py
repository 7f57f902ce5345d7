"""specexport as a harness method, in this process or in a worker process of its own, and
`specexport serve`'s app in this process for the scripts that measure it over HTTP (LocalServer).

A worker process (WorkerProcess) reads one JSON request per stdin line and answers each with
one '@@'-prefixed JSON line on stdout ('@@ready' once it has loaded; {"error": ...} for a bad
request); everything else it prints goes to its log. `python -m specexport.bench.harness_workers
ARTIFACT THREADS` is specexport's worker: it loads the artifact once (shared_pool=True, so
ONNX Runtime's process-wide thread pool is this process's alone) and answers
    {"op": "forget"}                                       -> {} after gen.forget_history()
    {"op": "generate", "ids", "mode", "new", "gamma"}      -> generation_row(...)
        (+ "grammar": {"kind", "source", "strict"}: decode under that structured.Grammar)
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from specexport_runtime.errors import SpecExportError

from .harness import Case, HarnessError, Method, make_cases, warmup_case

# what specexport keeps across requests, as every harness method built here handles it
SPECEXPORT_MEMORY = (
    "suffix store of earlier answers: cleared before every generation; learned costs and "
    "acceptance (verify-cost model, gamma controllers, suffix score calibration, draft-limit tuner) "
    "carry over"
)


def generation_row(
    gen, ids: Sequence[int], mode: str, max_new_tokens: int, gamma: int | None = None, **options
) -> dict:
    """One greedy gen.generate from token ids; mode 'off' (target only) or a proposer name, gamma
    None for the artifact's gamma policy, options further generate arguments (e.g. domain).
    -> {"tokens": the new ids (EOS excluded), "new_tokens", "seconds": wall seconds of the call,
    "first_seconds": its prefill, "decode_seconds": the generation's seconds after the prefill,
    "tok_s": decode tokens/s ((new - 1) / decode_seconds), "drafted", "accepted", "calls": target
    calls, "rounds": verify calls, "tree_rounds": those verifying a tree, "target_seconds"}."""
    # cold prefills (no prefix cache): a measured repeat never reuses an earlier one's prompt rows
    kw: dict = {"cache_prompt": False, **options, **({"speculative": False} if mode == "off" else {"proposer": mode})}
    if gamma is not None and mode != "off":
        kw["gamma"] = gamma
    start = time.perf_counter()
    res = gen.generate([int(t) for t in ids], max_new_tokens=max_new_tokens, **kw)
    seconds = time.perf_counter() - start
    st = res.stats
    return {
        "tokens": [int(t) for t in res.token_ids],
        "new_tokens": st.new_tokens,
        "seconds": seconds,
        "first_seconds": st.prefill_seconds,
        "decode_seconds": st.total_seconds - st.prefill_seconds,
        "tok_s": st.tokens_per_second,
        "drafted": st.drafted,
        "accepted": st.accepted,
        "calls": st.rounds + st.plain_steps,
        "rounds": st.rounds,  # verify calls (the rest of the calls are plain steps)
        "tree_rounds": st.tree_rounds,
        "target_seconds": st.target_seconds,
    }


def inprocess_method(gen, name: str, mode: str, max_new_tokens: int, gamma: int | None = None, **info) -> Method:
    """A Method generating with `gen` in this process; reset empties its suffix store."""
    return Method(
        name,
        lambda case: generation_row(gen, case.ids, mode, case.max_new_tokens or max_new_tokens, gamma),
        reset=gen.forget_history,
        memory=SPECEXPORT_MEMORY,
        info={"engine": "specexport", "mode": mode, **info},
    )


def artifact_methods(paths: Sequence[Path], prompts) -> tuple[list[dict], list[Case], Case, list[int]]:
    """Every artifact's specexport methods, target only and then each proposer it supports, as
    {"name": "specexport NAME MODE", "artifact", "mode", "off": its target-only method's name,
    "precision", "exactness"} (NAME: the folder's name, its path when two share one); the prompt
    cases (every artifact must tokenize them alike); the warm-up case and the EOS ids of all."""
    from specexport_runtime.api import open_artifact

    methods: list[dict] = []
    cases, eos, warm = None, set(), None
    names = [Path(p).name for p in paths]
    for path in map(Path, paths):
        if not (path / "manifest.json").is_file():
            raise HarnessError(f"{path} is not an artifact folder (no manifest.json)")
        manifest, codec, _ = open_artifact(path, verify=False)
        these = make_cases(codec, prompts)
        if cases is not None and these != cases:
            raise HarnessError(f"{path} tokenizes the prompts differently from {paths[0]}; use one tokenizer")
        cases, eos, warm = cases or these, eos | set(manifest.tokenizer.eos_token_ids), warm or warmup_case(codec)
        short = path.name if names.count(path.name) == 1 else str(path)
        target = manifest.target
        methods += [
            {
                "name": f"specexport {short} {mode}",
                "artifact": path,
                "mode": mode,
                "off": f"specexport {short} off",
                "precision": target.precision,
                "exactness": getattr(target, "exactness", None),
            }
            for mode in ["off", *manifest.speculative_proposers()]
        ]
    return methods, cases, warm, sorted(eos)


def _import_roots() -> str:
    """PYTHONPATH for a child that must import this checkout's specexport and specexport_runtime."""
    import specexport_runtime

    roots = [str(Path(__file__).resolve().parents[2]), str(Path(specexport_runtime.__file__).resolve().parents[1])]
    return os.pathsep.join(dict.fromkeys(roots + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


class WorkerProcess:
    """A line-JSON worker (module docstring); its stderr goes to `log`, named in errors."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None):
        """cwd: the worker's working directory (`python -m` imports from it first)."""
        self.name, self.log = name, log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=cwd
            )
        self._read()  # '@@ready'

    def _read(self) -> str:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return line[2:]
        lines = self.log.read_text(errors="replace").strip().splitlines()
        raise HarnessError(f"{self.name} died (exit {self.proc.wait()}): {(lines or ['-'])[-1][:200]}")

    def request(self, body: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(body) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: _read says why
        answer = json.loads(self._read())
        if "error" in answer:
            raise HarnessError(f"{self.name}: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class SpecexportWorker(WorkerProcess):
    """specexport's worker on one artifact (module docstring)."""

    def __init__(self, artifact: Path, threads: int, log: Path, checkout: Path | None = None):
        """checkout: the specexport source tree whose worker runs (default: this one). The worker
        runs in it, since `python -m` imports from its working directory first."""
        if checkout is None:
            root, roots, name = Path(__file__).resolve().parents[2], _import_roots(), Path(artifact).name
        else:
            root = Path(checkout).resolve()
            roots, name = os.pathsep.join([str(root), str(root / "runtime")]), f"{Path(artifact).name} ({root})"
        # a checkout from before the build side's subpackages keeps its worker at the top level
        module = "specexport.bench.harness_workers"
        if not (root / "specexport" / "bench" / "harness_workers.py").is_file():
            module = "specexport.harness_workers"
        super().__init__(
            f"specexport worker {name}",
            [sys.executable, "-m", module, str(Path(artifact).resolve()), str(threads)],
            log,
            env={**os.environ, "PYTHONPATH": roots},
            cwd=root,
        )

    def method(
        self, name: str, mode: str, max_new_tokens: int, gamma: int | None = None, grammars: dict | None = None, **info
    ) -> Method:
        """A Method generating in this worker; reset is a forget request. grammars: case id ->
        the structured.Grammar that case decodes under (absent: free)."""
        grammars = grammars or {}

        def run(case) -> dict:
            body = {
                "op": "generate",
                "ids": list(case.ids),
                "mode": mode,
                "new": case.max_new_tokens or max_new_tokens,
                "gamma": gamma,
            }
            if case.id in grammars:
                body["grammar"] = dataclasses.asdict(grammars[case.id])
            return self.request(body)

        return Method(
            name,
            run,
            reset=lambda: self.request({"op": "forget"}),
            memory=SPECEXPORT_MEMORY,
            info={"engine": "specexport", "mode": mode, **info},
        )


def main(argv: Sequence[str] | None = None) -> int:
    """The worker loop: ARTIFACT THREADS."""
    artifact, threads = list(sys.argv[1:] if argv is None else argv)
    from specexport_runtime.api import load
    from specexport_runtime.structured import Grammar

    gen = load(artifact, threads=int(threads), shared_pool=True)
    print("@@ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req.get("op") == "forget":
                gen.forget_history()
                out: dict = {}
            else:
                options = {"grammar": Grammar(**req["grammar"])} if req.get("grammar") else {}
                out = generation_row(gen, req["ids"], req["mode"], int(req["new"]), req.get("gamma"), **options)
        except (SpecExportError, KeyError, ValueError) as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print("@@" + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


class LocalServer:
    """`specexport serve`'s app for `gen` in this process, on a free localhost port, run by a
    daemon thread; `url` is its OpenAI base URL, `state` the app's state; close() drains it."""

    def __init__(self, gen):
        from specexport_runtime.server.config import ServerConfig
        from specexport_runtime.server.run import make_server

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = make_server(gen, ServerConfig(port=self.port), log_level="warning", access_log=False)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def state(self):
        return self.server.state

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
