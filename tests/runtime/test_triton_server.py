"""The `triton-repo` repository end to end through a real Triton Inference Server: the tritonserver 2.51
binary and Python backend that the nvidia-pytriton wheel bundles, run on this machine's CPU from
.venv-triton (scripts/triton_env). Greedy tokens through tritonclient's gRPC stream (decoupled, one
response per round) and through the HTTP generate extension equal in-process generation; bad input
gets a one-line error and the model answers the next request.

Marker `triton` (.ci/run's second pass, after scripts/triton_env)."""

from __future__ import annotations

import http.client
import json
import queue
import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient")

from test_server_support import answers_ok  # noqa: E402

from specexport_runtime.api import load  # noqa: E402
from specexport_runtime.triton.repo import RepoSettings, write_repository  # noqa: E402

pytestmark = pytest.mark.triton
ROOT = Path(__file__).parents[2]
ENV = ROOT / ".venv-triton"
KIND = "int8"
PROMPT = "The quick brown fox"
N = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _site_packages() -> Path:
    found = sorted(ENV.glob("lib/python3.*/site-packages"))
    if not found or not (found[0] / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
        pytest.skip("no .venv-triton with nvidia-pytriton's Triton server: run scripts/triton_env")
    return found[0]


@pytest.fixture(scope="module")
def triton(tiny_artifacts, tmp_path_factory):
    """A running tritonserver on the tiny artifact's repository: yields (http port, grpc port)."""
    site = _site_packages()
    dist = site / "pytriton" / "tritonserver"
    version = site.parent.name.removeprefix("python")  # the stub must match .venv-triton's Python
    tmp = tmp_path_factory.mktemp("tritonserver")
    server = Path(shutil.copytree(dist, tmp / "server", ignore=shutil.ignore_patterns("python_backend_stubs")))
    shutil.copy(dist / "python_backend_stubs" / version / "triton_python_backend_stub", server / "backends" / "python")
    repo = tmp / "models"
    write_repository(tiny_artifacts[KIND], repo, RepoSettings(name="tiny", threads=1))
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    env = {
        "PATH": f"{ENV / 'bin'}:/usr/bin:/bin",  # the backend's stub takes its Python environment from PATH
        "LD_LIBRARY_PATH": str(site / "nvidia_pytriton.libs"),
        "HOME": str(tmp),
    }
    log = open(tmp / "tritonserver.log", "wb")
    proc = subprocess.Popen(
        [
            str(server / "bin" / "tritonserver"),
            f"--model-repository={repo}",
            f"--backend-directory={server / 'backends'}",
            f"--http-port={http_port}",
            f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}",
            "--exit-timeout-secs=2",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not answers_ok(http_port, "/v2/health/ready"):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (tmp / "tritonserver.log").read_bytes()[-3000:].decode(errors="replace")
                raise AssertionError(f"tritonserver did not become ready:\n{tail}")
            time.sleep(0.5)
        yield http_port, grpc_port
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def want(tiny_artifacts):
    return load(tiny_artifacts[KIND], threads=1).generate(PROMPT, max_new_tokens=N, speculative=False)


def test_grpc_stream_through_triton_equals_in_process(triton, want):
    import tritonclient.grpc as grpcclient

    _, grpc_port = triton
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = []
    for name, dtype, value in (
        ("text_input", "BYTES", np.array([PROMPT.encode()], dtype=np.object_)),
        ("max_tokens", "INT32", np.array([N], dtype=np.int32)),
        ("stream", "BOOL", np.array([True])),
    ):
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client.async_stream_infer("tiny", inputs, request_id="1")
    tokens, text, responses = [], "", 0
    while True:
        result, error = results.get(timeout=60)
        assert error is None, error
        responses += 1
        reason = result.as_numpy("finish_reason")
        if reason is not None:  # the last response: the figures
            assert reason[0] == b"length" and int(result.as_numpy("drafted")[0]) > 0
            break
        tokens += result.as_numpy("token_ids").tolist()
        text += result.as_numpy("text_output")[0].decode()
    client.stop_stream()
    assert tokens == want.token_ids and text == want.text
    assert responses > 3  # streamed: one response per speculative round


def test_http_generate_extension_equals_in_process(triton, want):
    http_port, _ = triton
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
    conn.request("POST", "/v2/models/tiny/generate", body=json.dumps({"text_input": PROMPT, "max_tokens": N}))
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 200, body
    assert body["token_ids"] == want.token_ids and body["text_output"] == want.text
    assert body["finish_reason"] == "length" and json.loads(body["speculative"])["drafted"] == body["drafted"]


def test_bad_input_gets_a_one_line_invalid_argument_error_and_the_model_goes_on(triton, want):
    http_port, _ = triton
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
    conn.request("POST", "/v2/models/tiny/generate", body=json.dumps({"text_input": PROMPT, "max_tokens": 100_000}))
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 400, body  # the real backend takes TritonError(message, TritonError.INVALID_ARG)
    assert "max_tokens 100000 + the prompt's" in body["error"] and "\n" not in body["error"], body
    conn.request("POST", "/v2/models/tiny/generate", body=json.dumps({"text_input": PROMPT, "max_tokens": N}))
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["token_ids"] == want.token_ids
