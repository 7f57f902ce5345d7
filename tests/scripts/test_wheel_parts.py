"""scripts/wheel-parts: split / join round trip and the refusals (exact messages), without a GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "scripts" / "wheel-parts"
NAME = "pkg-1.0-py3-none-any.whl"
P = f"{NAME}.part"  # part name stem


def parts_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.fixture
def split_file(tmp_path):
    """A 2.5 MiB file cut into 1 MiB parts: (original, parts folder, manifest)."""
    src = tmp_path / NAME
    src.write_bytes(os.urandom(5 << 19))
    proc = parts_cli("split", src, tmp_path / "parts", "--size", "1")
    assert proc.returncode == 0, proc.stderr
    return src, tmp_path / "parts", json.loads((tmp_path / "parts" / f"{NAME}.parts.json").read_text())


def refused(parts: Path, out: Path) -> str:
    proc = parts_cli("join", parts, out)
    assert proc.returncode == 1, proc.stdout
    assert not out.exists() or not any(out.iterdir()), "a refused join left a file behind"
    return proc.stderr.strip()


def test_round_trip(split_file, tmp_path):
    src, parts, manifest = split_file
    assert sorted(p.name for p in parts.iterdir()) == [f"{P}001", f"{P}002", f"{P}003", f"{NAME}.parts.json"]
    assert [p["size"] for p in manifest["parts"]] == [1 << 20, 1 << 20, 1 << 19]
    assert manifest["file"]["name"] == NAME and manifest["file"]["size"] == 5 << 19
    proc = parts_cli("join", parts, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / NAME).read_bytes() == src.read_bytes()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [NAME]  # no temporary left


def test_default_size_is_56_mib(tmp_path):
    src = tmp_path / NAME
    src.write_bytes(b"x" * 1000)
    assert parts_cli("split", src, tmp_path / "parts").returncode == 0
    manifest = json.loads((tmp_path / "parts" / f"{NAME}.parts.json").read_text())
    assert manifest["part_size"] == 56 << 20 and len(manifest["parts"]) == 1


def test_parts_arriving_one_by_one(split_file, tmp_path):
    """Successive device calls each copy one part into the same folder: join works once all are there."""
    src, parts, _ = split_file
    remote = tmp_path / "remote"
    remote.mkdir()
    shutil.copy(parts / f"{NAME}.parts.json", remote)
    for i in (3, 1):
        shutil.copy(parts / f"{P}00{i}", remote)
    assert refused(remote, tmp_path / "out") == (
        f"wheel-parts: missing part {P}002 in {remote}: {NAME}.parts.json lists 3 parts ({P}001 .. {P}003)"
    )
    shutil.copy(parts / f"{P}002", remote)
    assert parts_cli("join", remote, tmp_path / "out").returncode == 0
    assert (tmp_path / "out" / NAME).read_bytes() == src.read_bytes()


def test_missing_part(split_file, tmp_path):
    _, parts, _ = split_file
    (parts / f"{P}003").unlink()
    assert refused(parts, tmp_path / "out") == (
        f"wheel-parts: missing part {P}003 in {parts}: {NAME}.parts.json lists 3 parts ({P}001 .. {P}003)"
    )


def test_extra_part(split_file, tmp_path):
    _, parts, _ = split_file
    shutil.copy(parts / f"{P}001", parts / f"{P}004")
    assert refused(parts, tmp_path / "out") == (
        f"wheel-parts: extra part {P}004: not listed by any manifest"
        f" ({NAME}.parts.json lists 3 parts ({P}001 .. {P}003))"
    )


def test_extra_part_of_an_unknown_file(split_file, tmp_path):
    _, parts, _ = split_file
    (parts / "other.whl.part001").write_bytes(b"x")
    assert refused(parts, tmp_path / "out") == (
        "wheel-parts: extra part other.whl.part001: not listed by any manifest"
        f" (no manifest other.whl.parts.json in {parts})"
    )


def test_truncated_part(split_file, tmp_path):
    _, parts, _ = split_file
    data = (parts / f"{P}002").read_bytes()
    (parts / f"{P}002").write_bytes(data[:-1])
    assert refused(parts, tmp_path / "out") == (
        f"wheel-parts: corrupted part {P}002: {(1 << 20) - 1} bytes, the manifest expects {1 << 20}"
    )


def test_corrupted_part_same_size(split_file, tmp_path):
    _, parts, manifest = split_file
    data = bytearray((parts / f"{P}002").read_bytes())
    data[100] ^= 0xFF
    (parts / f"{P}002").write_bytes(bytes(data))
    import hashlib

    got = hashlib.sha256(bytes(data)).hexdigest()
    assert refused(parts, tmp_path / "out") == (
        f"wheel-parts: corrupted part {P}002: sha256 {got[:16]}..,"
        f" the manifest expects {manifest['parts'][1]['sha256'][:16]}.."
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(format="zip-parts/9"), "format must be 'wheel-parts/1', got 'zip-parts/9'"),
        (lambda m: m["parts"].pop(), f"parts add up to {2 << 20} bytes, the file entry says {5 << 19}"),
        (lambda m: m["parts"][1].update(name="x.part002"), f"part 2 is named 'x.part002', expected '{P}002'"),
        (lambda m: m["parts"][0].update(sha256="abc"), "part 1 sha256 must be 64 lowercase hex digits, got 'abc'"),
        (lambda m: m.update(parts=[]), "parts must be a non-empty list, got []"),
        (lambda m: m["file"].update(name="../evil.whl"), "file name must be a plain file name, got '../evil.whl'"),
    ],
)
def test_bad_manifest(split_file, tmp_path, edit, message):
    _, parts, manifest = split_file
    edit(manifest)
    (parts / f"{NAME}.parts.json").write_text(json.dumps(manifest))
    assert refused(parts, tmp_path / "out") == f"wheel-parts: bad manifest {NAME}.parts.json: {message}"


def test_manifest_not_json(split_file, tmp_path):
    _, parts, _ = split_file
    (parts / f"{NAME}.parts.json").write_text("{not json")
    assert refused(parts, tmp_path / "out").startswith(
        f"wheel-parts: bad manifest {NAME}.parts.json: not readable JSON"
    )


def test_no_manifest(tmp_path):
    (tmp_path / "parts").mkdir()
    assert (
        refused(tmp_path / "parts", tmp_path / "out")
        == f"wheel-parts: no manifest (*.parts.json) in {tmp_path / 'parts'}"
    )


def test_resplit_removes_stale_parts(split_file, tmp_path):
    src, parts, _ = split_file
    assert parts_cli("split", src, parts, "--size", "2").returncode == 0
    assert sorted(p.name for p in parts.iterdir()) == [f"{P}001", f"{P}002", f"{NAME}.parts.json"]
    assert parts_cli("join", parts, tmp_path / "out").returncode == 0
