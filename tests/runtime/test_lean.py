"""The runtime stays lean: numpy, onnxruntime, tokenizers and jinja2 only (no torch,
transformers or the onnx python package), at install time and at run time."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "runtime"
ALLOWED = {"numpy", "onnxruntime", "tokenizers", "jinja2"}
FORBIDDEN = ("torch", "transformers", "onnx", "onnxscript", "specexport", "yaml", "click", "safetensors")

PROBE = r"""
import importlib.metadata as md, json, re, sys
import specexport_runtime
gen = specexport_runtime.load(sys.argv[1])  # the package-level API of the issue
result = gen.generate("def add(a, b):", max_new_tokens=12)
text = "".join(gen.stream([5, 6, 7], max_new_tokens=6, temperature=0.7, seed=1))
chat = gen.chat([{"role": "user", "content": "hi"}], max_new_tokens=4)

# distributions the allowed packages pull in (transitively), mapped to their top-level modules
def closure(names):
    seen, todo = set(), list(names)
    while todo:
        name = re.split(r"[<>=!~ ;\[]", todo.pop())[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [r for r in reqs if "extra ==" not in r]
    return seen
allowed = closure(sys.argv[2].split(","))
owners = md.packages_distributions()
top = sorted({m.split(".")[0] for m in sys.modules})
third_party = [m for m in top if m not in sys.stdlib_module_names and not m.startswith("_")]
outside = [m for m in third_party if m not in ("specexport_runtime", "cython_runtime")
           and not any(d.lower().replace("_", "-") in allowed for d in owners.get(m, []))]
print(json.dumps({"new_tokens": result.stats.new_tokens, "chat_tokens": chat.stats.new_tokens,
                  "modules": sorted(sys.modules), "third_party": third_party, "outside": outside,
                  "proposer": gen.default_proposer}))
"""


def test_runtime_imports_nothing_heavy(tiny_artifacts, tmp_path):
    """A fresh interpreter loads the int8 self-draft artifact, generates, streams and chats,
    then holds no module outside the standard library and the allowed packages' closure."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(tiny_artifacts["int8"]), ",".join(sorted(ALLOWED))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # not the repo: no stray imports
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["new_tokens"] == 12 and report["chat_tokens"] == 4
    assert report["proposer"] == "draft"  # the draft model really ran
    loaded = {m.split(".")[0] for m in report["modules"]}
    for name in FORBIDDEN:
        assert name not in loaded, f"{name} was imported by the runtime"
    assert {"numpy", "onnxruntime", "tokenizers", "jinja2"} <= loaded
    assert report["outside"] == [], f"modules outside the allowed dependencies: {report['outside']}"


def _dist_name(requirement: str) -> str:
    name = requirement
    for sep in "<>=!~[; ":
        name = name.split(sep)[0]
    return name.lower().replace("_", "-")


def test_runtime_declares_only_lean_dependencies():
    data = tomllib.loads((RUNTIME / "pyproject.toml").read_text(encoding="utf-8"))
    deps = {_dist_name(r) for r in data["project"]["dependencies"]}
    assert deps == ALLOWED, deps
    # the optional GPU extras are the accelerated onnxruntime and TensorRT, never torch
    for extra, reqs in data["project"].get("optional-dependencies", {}).items():
        for r in reqs:
            assert _dist_name(r) not in ("torch", "transformers", "onnx"), (extra, r)


# optional extras ([tensorrt]: tensorrt, cuda-python) may only be imported inside functions
OPTIONAL = {
    "tensorrt",
    "cuda",
    "cryptography",
    "llguidance",
}  # lazy: TensorRT extras, the [sign] and [structured] extras
SERVE = {"uvicorn", "starlette", "prometheus_client"}  # the [serve] extra: only in specexport_runtime/server/
# what each optional package of the runtime may import besides: its extra
EXTRAS = {
    "server": SERVE,
    "cluster": SERVE | {"ray"},  # the [cluster] extra: ray[serve] and the [serve] extra (the replicas run the app)
    "triton": {"triton_python_backend_utils"},  # the module Triton's Python backend provides model.py
}


def _imported_roots(path: Path) -> tuple[set[str], set[str]]:
    """(roots imported at module level, roots imported inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lazy_nodes = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lazy_nodes |= {id(n) for n in ast.walk(fn) if n is not fn}
    top, lazy = set(), set()
    for node in ast.walk(tree):
        roots = set()
        if isinstance(node, ast.Import):
            roots = {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots = {node.module.split(".")[0]}
        (lazy if id(node) in lazy_nodes else top).update(roots)
    return top, lazy


def test_runtime_sources_import_only_allowed_modules():
    """Static check of every runtime module, including imports inside functions (lazy imports
    on rare paths): module level only the allowed packages; in functions also the optional
    TensorRT extras; the server, cluster and triton packages also their extras (EXTRAS); torch /
    transformers / onnx nowhere."""
    sources = sorted((RUNTIME / "specexport_runtime").rglob("*.py"))
    assert sources
    ok = ALLOWED | set(sys.stdlib_module_names) | {"__future__", "specexport_runtime"}
    for path in sources:
        top, lazy = _imported_roots(path)
        rel = path.relative_to(REPO)
        extra = EXTRAS.get(path.relative_to(RUNTIME / "specexport_runtime").parts[0], set())
        assert not top - ok - extra, f"{rel} imports {sorted(top - ok - extra)} at module level"
        assert not lazy - ok - OPTIONAL - extra, f"{rel} imports {sorted(lazy - ok - OPTIONAL - extra)} in a function"
        assert not (top | lazy) & set(FORBIDDEN), rel


def test_static_import_check_sees_lazy_imports(tmp_path):
    """The checker above distinguishes module-level from function-level imports."""
    src = tmp_path / "m.py"
    src.write_text(
        "import numpy\ntry:\n    import torch\nexcept ImportError:\n    pass\n"
        "def f():\n    import tensorrt\n    from cuda import cudart\n",
        encoding="utf-8",
    )
    assert _imported_roots(src) == ({"numpy", "torch"}, {"tensorrt", "cuda"})


def test_contract_and_manifest_import_without_onnxruntime(tmp_path):
    """The build side reads the shared contract and manifest modules; importing them (and the
    package) does not start ONNX Runtime: `specexport_runtime.load` is resolved on first use."""
    probe = (
        "import sys, specexport_runtime, specexport_runtime.contract, specexport_runtime.manifest\n"
        "before = 'onnxruntime' in sys.modules\n"
        "load = specexport_runtime.load\n"
        "print(before, 'onnxruntime' in sys.modules, load.__module__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "specexport_runtime.api"]
