"""Single-file packages (runtime/specexport_runtime/package.py): pack -> unpack round trip,
members that could escape, signatures, atomic switch with rollback, and an unpack killed at any
moment leaving the previous version loadable."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from specexport_runtime.api import load
from specexport_runtime.errors import ArtifactError
from specexport_runtime.manifest import read_manifest
from specexport_runtime.package import PackageError, pack, peek_manifest, rollback, unpack


@pytest.fixture(scope="module")
def spx(tiny_artifacts, tmp_path_factory):
    out = tmp_path_factory.mktemp("spx") / "tiny.spx"
    pack(Path(tiny_artifacts["ngram"]), out)
    return out


def test_round_trip_and_manifest_first(spx, tmp_path, tiny_artifacts):
    with tarfile.open(spx) as tar:
        names = tar.getnames()
    assert names[0] == "manifest.json" and "target/model.onnx" in names
    version = unpack(spx, tmp_path / "model")
    assert (tmp_path / "model").is_symlink() and (tmp_path / "model").resolve() == version.resolve()
    ref = load(tiny_artifacts["ngram"]).generate([5, 6, 7], max_new_tokens=8).token_ids
    assert load(tmp_path / "model").generate([5, 6, 7], max_new_tokens=8).token_ids == ref


def _evil(tmp_path: Path, spx: Path, add) -> Path:
    """A copy of `spx` with extra members written by `add(tar)`."""
    out = tmp_path / "evil.spx"
    with tarfile.open(spx) as src, tarfile.open(out, "w") as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m))
        add(dst)
    return out


def _file(tar, name: str, data: bytes = b"x") -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize(
    "add, message",
    [
        (lambda t: _file(t, "../escape.txt"), "outside the artifact"),
        (lambda t: _file(t, "/abs.txt"), "outside the artifact"),
        (lambda t: t.addfile(_link("link", "/etc/passwd")), "not a regular file"),
        (lambda t: _file(t, "extra.txt"), "not listed in its manifest"),
        (lambda t: _file(t, "manifest.json", b"{}"), "appears twice"),
    ],
)
def test_escaping_or_foreign_members_are_refused(spx, tmp_path, add, message):
    with pytest.raises(PackageError, match=message):
        unpack(_evil(tmp_path, spx, add), tmp_path / "model")
    assert not (tmp_path / "model").exists() and not (tmp_path / "escape.txt").exists()
    assert not list((tmp_path / "model.versions").glob(".unpack-*"))  # nothing half-written left


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "x\ny", 'q"uote', ""])
def test_a_manifest_name_that_could_leave_its_folder_is_refused(spx, tmp_path, name):
    """unpack names the version folder after the manifest: a name with a path in it would land it
    elsewhere (without a signature nothing else stops such a package)."""
    import json

    out = tmp_path / "renamed.spx"
    with tarfile.open(spx) as src, tarfile.open(out, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if m.name == "manifest.json":
                data = json.dumps({**json.loads(data), "name": name}).encode()
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    with pytest.raises(ArtifactError, match="is not a plain name"):
        unpack(out, tmp_path / "model")
    with pytest.raises(ArtifactError, match="is not a plain name"):
        peek_manifest(out)
    assert not (tmp_path / "model").exists() and not list(tmp_path.glob("escape*"))


def test_peek_manifest_reads_a_package_without_unpacking_it(spx, tiny_artifacts, tmp_path):
    assert peek_manifest(spx) == read_manifest(tiny_artifacts["ngram"])
    with pytest.raises(PackageError, match="not a readable .spx"):
        peek_manifest(tmp_path / "absent.spx")
    with pytest.raises(PackageError, match="does not start with manifest.json"):
        reordered = tmp_path / "reordered.spx"
        with tarfile.open(spx) as src, tarfile.open(reordered, "w") as dst:
            members = src.getmembers()
            for m in members[1:] + members[:1]:
                dst.addfile(m, src.extractfile(m))
        peek_manifest(reordered)


def _link(name: str, to: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, to
    return info


def test_manifest_must_come_first(spx, tmp_path):
    out = tmp_path / "reordered.spx"
    with tarfile.open(spx) as src, tarfile.open(out, "w") as dst:
        members = src.getmembers()
        for m in members[1:] + members[:1]:
            dst.addfile(m, src.extractfile(m))
    with pytest.raises(PackageError, match="first member"):
        unpack(out, tmp_path / "model")


def test_signed_package(tiny_artifacts, tmp_path):
    pytest.importorskip("cryptography")
    from specexport_runtime.signing import SignatureError, keygen, sign

    root = Path(shutil.copytree(tiny_artifacts["ngram"], tmp_path / "art"))
    private, public = keygen(tmp_path / "keys")
    _, other = keygen(tmp_path / "keys", name="other")
    unsigned = pack(root, tmp_path / "unsigned.spx")
    sign(root, private)
    signed = pack(root, tmp_path / "signed.spx")
    unpack(signed, tmp_path / "ok", trusted_keys=[public])
    with pytest.raises(SignatureError, match="not signed"):
        unpack(unsigned, tmp_path / "a", trusted_keys=[public])
    with pytest.raises(SignatureError, match="not among the trusted keys"):
        unpack(signed, tmp_path / "b", trusted_keys=[other])


def test_versions_rollback_and_keep(spx, tmp_path):
    target = tmp_path / "model"
    first = unpack(spx, target)
    time.sleep(0.01)
    second = unpack(spx, target, keep=1)
    assert target.resolve() == second.resolve() and first.exists()
    assert rollback(target).resolve() == first.resolve() and target.resolve() == first.resolve()
    time.sleep(0.01)
    third = unpack(spx, target, keep=0)  # only the current version stays
    assert [p for p in (tmp_path / "model.versions").iterdir()] == [third]
    with pytest.raises(Exception, match="plain folder"):
        (tmp_path / "plain").mkdir()
        unpack(spx, tmp_path / "plain")


KILLER = r"""
import sys
from specexport_runtime.package import unpack
unpack(sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.1, 0.2, 0.4, 0.8])
def test_an_unpack_killed_at_any_moment_leaves_the_previous_version(spx, tmp_path, delay):
    """SIGKILL an unpack after `delay` seconds (before, during or after the copy): the target
    still points at a complete version that loads (the old one, or the new one if it finished)."""
    target = tmp_path / "model"
    old = unpack(spx, target)
    proc = subprocess.Popen([sys.executable, "-c", KILLER, str(spx), str(target)])
    time.sleep(delay)
    proc.kill()
    proc.wait()
    assert target.is_symlink()
    assert load(target).generate([5, 6, 7], max_new_tokens=3).token_ids
    now = target.resolve()  # the old version, or the new one if the kill came after the switch
    assert now == old.resolve() or (now.parent == old.resolve().parent and not now.name.startswith("."))
    unpack(spx, target)  # the next unpack cleans what the killed one left
    assert not list((tmp_path / "model.versions").glob(".unpack-*"))


def test_unpack_removes_the_link_a_killed_switch_left(spx, tmp_path):
    """A process killed between making its switch link and renaming it over the target leaves
    `.unpack-link-PID` (a symlink, which rmtree refuses): the next unpack removes it too."""
    target = tmp_path / "model"
    old = unpack(spx, target)
    stale = tmp_path / "model.versions" / ".unpack-link-999999"
    os.symlink(old.name, stale)
    (tmp_path / "model.versions" / ".unpack-999999-1").mkdir()
    unpack(spx, target)
    assert not list((tmp_path / "model.versions").glob(".unpack-*"))


def test_cli_pack_unpack_rollback(tiny_artifacts, tmp_path):
    from click.testing import CliRunner

    from specexport.cli.main import cli
    from specexport_runtime.cli import main

    out = CliRunner().invoke(cli, ["pack", str(tiny_artifacts["ngram"]), "-o", str(tmp_path / "a.spx")])
    assert out.exit_code == 0 and (tmp_path / "a.spx").is_file(), out.output
    assert main(["unpack", str(tmp_path / "a.spx"), "--into", str(tmp_path / "m")]) == 0
    assert main(["unpack", str(tmp_path / "a.spx"), "--into", str(tmp_path / "m")]) == 0
    assert main(["rollback", str(tmp_path / "m")]) == 0
    (tmp_path / "bad.spx").write_bytes(b"garbage")
    assert main(["unpack", str(tmp_path / "bad.spx"), "--into", str(tmp_path / "n")]) == 2  # typed, one line
