"""Signed artifacts (runtime/specexport_runtime/signing.py): sign -> verify, and every refusal
of docs/artifact.md: a changed byte in any file, a changed manifest, a wrong key, a missing or
malformed signature; without trusted keys nothing changes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from click.testing import CliRunner

from specexport.cli.main import cli
from specexport_runtime.api import load
from specexport_runtime.errors import ChecksumError, InvalidArgument
from specexport_runtime.manifest import read_manifest
from specexport_runtime.signing import SIGNATURE_NAME, SignatureError, keygen, sign, verify


@pytest.fixture()
def signed(tiny_artifacts, tmp_path):
    root = Path(shutil.copytree(tiny_artifacts["ngram"], tmp_path / "art"))
    private, public = keygen(tmp_path / "keys")
    sign(root, private)
    return root, private, public, tmp_path


def test_sign_then_verify_and_load(signed):
    root, private, public, _ = signed
    assert (root / SIGNATURE_NAME).is_file() and (private.stat().st_mode & 0o777) == 0o600
    assert len(verify(root, [public])) == 16
    gen = load(root, trusted_keys=[public])
    assert gen.generate([5, 6, 7], max_new_tokens=3).token_ids
    assert SIGNATURE_NAME not in read_manifest(root).files  # the signature is never a listed file


def test_a_changed_file_byte_is_refused(signed):
    root, _, public, _ = signed
    graph = root / "target" / "model.onnx.data"
    data = bytearray(graph.read_bytes())
    data[100] ^= 1
    graph.write_bytes(bytes(data))
    verify(root, [public])  # the manifest is intact: its signature holds ...
    with pytest.raises(ChecksumError):  # ... and the checksums it signs catch the file
        load(root, trusted_keys=[public])


def test_a_changed_manifest_is_refused(signed):
    root, _, public, _ = signed
    m = json.loads((root / "manifest.json").read_text())
    m["speculation"]["gamma"] = 3
    (root / "manifest.json").write_text(json.dumps(m, indent=4))
    with pytest.raises(SignatureError, match="does not match its manifest"):
        load(root, trusted_keys=[public])


def test_reformatting_the_manifest_keeps_the_signature(signed):
    root, _, public, _ = signed
    m = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps(m, indent=1))
    verify(root, [public])


def test_a_wrong_key_is_refused(signed):
    root, _, _, tmp = signed
    _, other = keygen(tmp / "other", name="other")
    with pytest.raises(SignatureError, match="not among the trusted keys"):
        load(root, trusted_keys=[other])


def test_missing_and_malformed_signatures_are_refused(signed):
    root, _, public, _ = signed
    (root / SIGNATURE_NAME).write_text("{not json")
    with pytest.raises(SignatureError, match="malformed"):
        load(root, trusted_keys=[public])
    (root / SIGNATURE_NAME).unlink()
    with pytest.raises(SignatureError, match="not signed"):
        load(root, trusted_keys=[public])
    assert load(root).manifest.name  # without trusted keys: as before


def test_keygen_never_overwrites_and_bad_keys_are_typed(tmp_path):
    keygen(tmp_path)
    with pytest.raises(InvalidArgument, match="never overwrites"):
        keygen(tmp_path)
    (tmp_path / "bad.pub").write_text("nope")
    with pytest.raises(InvalidArgument, match="not a readable PEM public key"):
        verify(tmp_path, [tmp_path / "bad.pub"])


def test_cli_keygen_sign_inspect(tiny_artifacts, tmp_path):
    root = Path(shutil.copytree(tiny_artifacts["ngram"], tmp_path / "art"))
    runner = CliRunner()
    out = runner.invoke(cli, ["keygen", "--out", str(tmp_path / "k")])
    assert out.exit_code == 0, out.output
    out = runner.invoke(cli, ["inspect", str(root)])
    assert "not signed" in out.output
    out = runner.invoke(cli, ["sign", str(root), "--key", str(tmp_path / "k" / "specexport.key")])
    assert out.exit_code == 0, out.output
    out = runner.invoke(cli, ["inspect", str(root), "--trusted-key", str(tmp_path / "k" / "specexport.pub")])
    assert out.exit_code == 0 and "signature: verified" in out.output, out.output


def test_runtime_cli_refuses_unsigned_with_trusted_key(tiny_artifacts, tmp_path, capsys):
    """generate and serve take --trusted-key: an unsigned artifact stops before anything runs."""
    from specexport_runtime.cli import main

    _, public = keygen(tmp_path / "keys")
    art = str(tiny_artifacts["ngram"])
    assert main(["generate", art, "--prompt", "hi", "--trusted-key", str(public)]) == 2
    assert "is not signed" in capsys.readouterr().err
    pytest.importorskip("uvicorn")
    assert main(["serve", art, "--port", "0", "--trusted-key", str(public)]) == 2
    assert "is not signed" in capsys.readouterr().err
