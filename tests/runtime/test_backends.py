"""api.load's backend selection (loading.py): what a backend cannot run is refused in one line
before anything is read; the CLI and the cluster options pass --backend through; and
load(backend="tensorrt") on the CPU stand-in for TensorRT and cuda-python (tests/trt_fake.py)
goes through the same signature, checksum, config and proposer path as ONNX Runtime. The stand-in
runs the graphs on ONNX Runtime's CPU provider: this checks the loader, not TensorRT, and nothing
here ran on a GPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specexport_runtime.config import GeneratorConfig
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.trt_engines import EngineMismatch


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"backend": "tensorrt", "batch": True}, "(batch=True, serve --max-batch > 1) needs backend 'onnxruntime'"),
        ({"backend": "tensorrt", "config": {"tree_nodes": 6}}, "tree_nodes 6 needs backend 'onnxruntime'"),
        ({"backend": "tensorrt", "config": GeneratorConfig(tree_nodes=3)}, "tree_nodes 3 needs"),
        ({"backend": "tensorrt", "provider": "cuda"}, "provider 'cuda' is an ONNX Runtime execution provider"),
        ({"backend": "tensorrt", "threads": 2}, "threads 2 sets ONNX Runtime's"),
        ({"backend": "tensorrt", "prepack": False}, "prepack=False"),
        ({"backend": "vulkan"}, "backend must be one of onnxruntime, tensorrt, got 'vulkan'"),
    ],
)
def test_what_a_backend_cannot_run_is_refused_before_anything_loads(tmp_path, options, needle):
    """One typed line naming the value; the artifact path does not even exist (nothing is read)."""
    from specexport_runtime.api import load

    with pytest.raises(InvalidArgument) as info:
        load(tmp_path / "missing", **options)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_cli_backend_option_reaches_load(monkeypatch, capsys, tmp_path):
    """--backend is listed with its help by generate and serve, and passed to api.load as is."""
    from specexport_runtime import api, cli

    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        out = capsys.readouterr().out
        assert "--backend {onnxruntime,tensorrt}" in out and "trt_build" in out
    seen = {}

    def spy(artifact, **kwargs):
        seen.update(kwargs)
        raise InvalidArgument("stop here")

    monkeypatch.setattr(api, "load", spy)
    assert cli.main(["generate", str(tmp_path), "--prompt", "hello", "--backend", "tensorrt"]) == 2
    assert seen["backend"] == "tensorrt" and "stop here" in capsys.readouterr().err
    monkeypatch.undo()
    assert (
        cli.main(
            ["generate", str(tmp_path / "missing"), "--prompt", "hi", "--backend", "tensorrt", "--tree-nodes", "4"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: tree_nodes 4 needs backend 'onnxruntime'") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        cli.main(["generate", str(tmp_path), "--prompt", "hello", "--backend", "vulkan"])


def test_serve_on_tensorrt_defaults_to_one_slot(tiny_artifacts, monkeypatch, capsys):
    """Without --max-batch, serve takes the artifact's slots on onnxruntime and one on tensorrt."""
    pytest.importorskip("uvicorn")
    from specexport_runtime import api, cli

    root = str(tiny_artifacts["noisy-fused-batch4"])
    seen = []

    def spy(artifact, **kwargs):
        seen.append((kwargs["backend"], kwargs["batch"]))
        raise InvalidArgument("stop here")

    monkeypatch.setattr(api, "load", spy)
    assert cli.main(["serve", root, "--port", "0"]) == 2
    assert cli.main(["serve", root, "--port", "0", "--backend", "tensorrt"]) == 2
    assert seen == [("onnxruntime", True), ("tensorrt", False)]
    capsys.readouterr()


def test_cluster_options_refuse_what_the_backend_cannot_run():
    from specexport_runtime.cluster.config import ClusterConfig, LoadOptions
    from specexport_runtime.server.config import ServerConfig

    with pytest.raises(InvalidArgument, match="got 'vulkan'"):
        LoadOptions(backend="vulkan")
    with pytest.raises(InvalidArgument, match="provider 'cuda'"):
        LoadOptions(backend="tensorrt", provider="cuda")
    trt = LoadOptions(backend="tensorrt")
    assert ClusterConfig(server=ServerConfig(max_batch=1), load=trt).load.backend == "tensorrt"
    with pytest.raises(InvalidArgument, match="serve --max-batch > 1"):
        ClusterConfig(server=ServerConfig(max_batch=4), load=trt)


# load(backend="tensorrt") through the CPU stand-in for TensorRT and cuda-python (tests/trt_fake.py): the
# loader's path (signature, checksums, config, engines.json records, proposers), not TensorRT itself


@pytest.fixture
def engines(tiny_artifacts, tmp_path, monkeypatch):
    """A copy of the portable EAGLE-3 artifact with stand-in engines of its target and head."""
    import trt_fake

    root = Path(shutil.copytree(tiny_artifacts["eagle3-portable"], tmp_path / "art"))
    trt, _ = trt_fake.install(monkeypatch)
    trt_fake.write_engines(root)
    return root, trt


def test_load_on_tensorrt_runs_config_and_proposers(engines):
    from specexport_runtime.api import load
    from specexport_runtime.trt_backend import TrtModel

    root, trt = engines
    prompt = [17, 88, 203, 5, 61, 144, 9, 250, 33, 71, 120, 8]
    want = load(root).generate(prompt, max_new_tokens=24, speculative=False).token_ids
    gen = load(root, backend="tensorrt", config={"proposer": "eagle", "gamma": 3})
    assert isinstance(gen.target, TrtModel) and isinstance(gen.draft, TrtModel) and len(trt.engines) == 2
    assert (gen.config.proposer, gen.config.gamma) == ("eagle", 3) and gen.slots is None and gen.tree is None
    result = gen.generate(prompt, max_new_tokens=24)
    assert result.token_ids == want and result.stats.drafted > 0
    assert any(c["profile"] == 1 for c in trt.engines[0].calls)  # verified on the verify profile
    assert gen.generate(prompt, max_new_tokens=24, speculative=False).token_ids == want
    with pytest.raises(InvalidArgument, match="tree_nodes 4 needs the target's tree graph"):
        gen.generate(prompt, tree_nodes=4)


def test_load_on_tensorrt_refuses_a_fused_artifact_before_its_engines(tiny_artifacts, monkeypatch):
    import trt_fake

    from specexport_runtime.api import load
    from specexport_runtime.errors import ContractError

    trt, _ = trt_fake.install(monkeypatch)
    with pytest.raises(ContractError, match="runs time_major graphs .* this graph is head_major_inplace"):
        load(tiny_artifacts["noisy-fused"], backend="tensorrt", verify=False)  # no engines.json: not looked up
    assert trt.engines == []


def test_load_on_tensorrt_checks_signature_checksums_and_records(engines, tmp_path):
    pytest.importorskip("cryptography")
    from specexport_runtime.api import load
    from specexport_runtime.errors import ChecksumError
    from specexport_runtime.signing import SignatureError, keygen, sign

    root, trt = engines
    private, public = keygen(tmp_path / "keys")
    with pytest.raises(SignatureError):  # unsigned
        load(root, backend="tensorrt", trusted_keys=[public])
    sign(root, private)
    assert load(root, backend="tensorrt", trusted_keys=[public]).target.spec.feature_width
    loaded = len(trt.engines)
    data = next(root.glob("target/*.data"))
    flipped = bytearray(data.read_bytes())
    flipped[100] ^= 1
    data.write_bytes(bytes(flipped))
    with pytest.raises(ChecksumError):
        load(root, backend="tensorrt", trusted_keys=[public], verify=False)  # keys imply the checksums
    assert len(trt.engines) == loaded  # refused before any engine was opened
    (root / "engines.json").unlink()
    with pytest.raises(EngineMismatch, match="Build it here: python -m specexport_runtime.trt_build"):
        load(root, backend="tensorrt", verify=False)
