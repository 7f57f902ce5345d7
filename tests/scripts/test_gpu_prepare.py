"""scripts/gpu-prepare with pip stubbed (nothing is downloaded): the download command, the parts,
the plan of device calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "scripts" / "gpu-prepare"
ORT = "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
STUB = """
import json, pathlib, sys
args = sys.argv[1:]
log = pathlib.Path(sys.argv[0]).with_suffix(".log")
log.open("a").write(json.dumps(args) + "\\n")
folder = pathlib.Path(args[args.index("-d") + 1])
name, version = args[-1].split("==")
folder.mkdir(parents=True, exist_ok=True)
if name == "onnxruntime-gpu":
    (folder / f"onnxruntime_gpu-{version}-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"o" * (5 << 19))
elif name == "missing-pkg":
    print("ERROR: No matching distribution found for missing-pkg==1.0", file=sys.stderr); sys.exit(1)
else:
    (folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"e" * 1000)
"""


def prepare(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    stub = tmp_path / "pipstub.py"
    stub.write_text(STUB)
    cmd = [
        sys.executable,
        str(TOOL),
        "--repo",
        str(tmp_path),
        "--out",
        str(tmp_path / "gpu-parts"),
        "--size",
        "1",
        "--pip",
        f"{sys.executable} {stub}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_download_split_and_plan(tmp_path):
    (tmp_path / "gpu-parts").mkdir()
    (tmp_path / "gpu-parts" / "old.whl.part009").write_bytes(b"stale")  # an earlier run's part
    proc = prepare(tmp_path, "--extra", "tiny-extra==0.1")
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in (tmp_path / "pipstub.log").read_text().splitlines()]
    common = [
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--platform",
        "manylinux_2_28_x86_64",
        "-d",
        str(tmp_path / "gpu-parts" / "wheels"),
    ]
    assert calls == [common + ["onnxruntime-gpu==1.31.1"], common + ["tiny-extra==0.1"]]
    out = tmp_path / "gpu-parts"
    assert not (out / "old.whl.part009").exists()
    assert sorted(p.name for p in out.glob("*.part[0-9]*")) == [
        f"{ORT}.part001",
        f"{ORT}.part002",
        f"{ORT}.part003",
        "tiny_extra-0.1-py3-none-any.whl.part001",
    ]
    plan = json.loads((out / "plan.json").read_text())
    assert [p["size"] for p in plan["parts"]] == [1 << 20, 1 << 20, 1 << 19, 1000]
    m = f"gpu-parts/{ORT}.parts.json"
    extra = "gpu-parts/tiny_extra-0.1-py3-none-any.whl"
    assert [c["carry"] for c in plan["calls"]] == [
        [f"gpu-parts/{ORT}.part001", m],
        [f"gpu-parts/{ORT}.part002", m],
        [f"gpu-parts/{ORT}.part003", m, f"{extra}.part001", f"{extra}.parts.json"],
    ]  # the small wheel rides along
    first, last = plan["calls"][0], plan["calls"][-1]
    assert (
        first["command"]
        == f"mkdir -p /tmp/gpu-parts && cp gpu-parts/{ORT}.part001 {m} /tmp/gpu-parts/ && ls -l /tmp/gpu-parts"
    )
    assert first["timeout_s"] == 60 and not first["runs_check"]
    assert last["runs_check"] and last["timeout_s"] == 330 + 90
    assert last["command"].startswith("set -o pipefail; mkdir -p /tmp/gpu-parts && cp ")
    assert last["command"].endswith(
        "&& scripts/device-check --install-parts /tmp/gpu-parts --out $OUT/device-check.json"
        " --summary $OUT/device-check.md --budget 330 2>&1 | tee $OUT/device-check.log"
    )
    assert "call 3/3 (copy + install + check" in proc.stdout and f"{ORT}.part003  0.5 MiB" in proc.stdout
    joined = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "wheel-parts"), "join", str(out), str(tmp_path / "j")],
        capture_output=True,
        text=True,
    )
    assert joined.returncode == 0, joined.stderr
    assert (tmp_path / "j" / ORT).read_bytes() == b"o" * (5 << 19)


def test_unpinned_extra_is_refused(tmp_path):
    proc = prepare(tmp_path, "--extra", "click")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "gpu-prepare: requirement 'click' must be pinned as NAME==VERSION"


def test_failed_download_is_reported(tmp_path):
    proc = prepare(tmp_path, "--extra", "missing-pkg==1.0")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "gpu-prepare: pip download missing-pkg==1.0 failed (exit 1):"
        " ERROR: No matching distribution found for missing-pkg==1.0"
    )


def test_out_outside_the_repo_is_refused(tmp_path):
    stub = tmp_path / "pipstub.py"
    stub.write_text(STUB)
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--repo",
            str(tmp_path / "repo"),
            "--out",
            str(tmp_path / "elsewhere"),
            "--pip",
            f"{sys.executable} {stub}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"gpu-prepare: --out {tmp_path / 'elsewhere'} must lie inside the repository"
        f" {tmp_path / 'repo'} (the device tool carries repository paths)"
    )


def test_gitignore_keeps_parts_out_of_git():
    assert "/gpu-parts/" in (REPO / ".gitignore").read_text().splitlines()
