"""Every path an artifact names stays inside the artifact folder.

A manifest (and an ONNX graph's external-data entries) names files by relative POSIX paths. A
path is refused when it is absolute (POSIX or Windows, drive or UNC), contains `..`, a
backslash or a NUL, is empty, or, resolved against the folder (symlinks followed), lands
outside it. Nothing outside the folder is opened: the checks run before any read.

`external_data_locations` lists the external-data `location` entries of an ONNX file without
the `onnx` package (the runtime does not depend on it): a minimal protobuf wire-format walk of
ModelProto.graph (7) -> initializer (5) / node (1) -> attribute (5) -> t (5) / g (6) / tensors
(10) / graphs (11) -> TensorProto.external_data (13) -> key (1) / value (2).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import ArtifactError

MAX_GRAPH_BYTES = 1 << 31  # a graph file (weights external) is far smaller; larger ones are not scanned whole


class PathError(ArtifactError):
    """A path named by an artifact points outside it (or is not a plain relative path)."""


def confined(root: Path, rel: object, what: str) -> Path:
    """root / rel, after checking that rel stays inside root (module docstring)."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise PathError(f"{what} {rel!r} is not a relative POSIX path inside the artifact")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or PureWindowsPath(rel).is_absolute() or PureWindowsPath(rel).drive:
        raise PathError(f"{what} {rel!r} is an absolute path; artifact paths are relative to its folder")
    if ".." in pure.parts:
        raise PathError(f"{what} {rel!r} contains '..'; artifact paths stay inside its folder")
    base = Path(root).resolve()
    path = (base / pure).resolve()  # follows symlinks (missing tails are kept as written)
    if path != base and base not in path.parents:
        raise PathError(
            f"{what} {rel!r} resolves to {str(path)!r}, outside the artifact folder {str(base)!r}"
            " (a symlink leaving it?)"
        )
    return Path(root) / pure


# ------------------------------------------------------------------ protobuf wire format


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of one message: value is bytes for length-delimited fields."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise ValueError("truncated field")
            value, i = buf[i : i + n], i + n
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield number, wire, value


def _tensor_locations(tensor: bytes, out: list[str]) -> None:
    for number, wire, value in _fields(tensor):
        if number == 13 and wire == 2:  # external_data: StringStringEntryProto
            entry = {n: v for n, w, v in _fields(value) if w == 2}
            if entry.get(1) == b"location":
                out.append(entry.get(2, b"").decode("utf-8", "replace"))


def _graph_locations(graph: bytes, out: list[str], depth: int) -> None:
    if depth > 16:
        raise ValueError("subgraphs nested deeper than 16")
    for number, wire, value in _fields(graph):
        if wire != 2:
            continue
        if number == 5:  # initializer
            _tensor_locations(value, out)
        elif number == 1:  # node -> attribute (5)
            for n, w, attr in _fields(value):
                if n != 5 or w != 2:
                    continue
                for an, aw, av in _fields(attr):
                    if aw != 2:
                        continue
                    if an in (5, 10):  # t, tensors
                        _tensor_locations(av, out)
                    elif an in (6, 11):  # g, graphs
                        _graph_locations(av, out, depth + 1)


def external_data_locations(path: Path) -> list[str]:
    """The `location` of every external-data tensor in an ONNX file (main graph and subgraphs)."""
    try:
        size = path.stat().st_size
        if size > MAX_GRAPH_BYTES:
            raise PathError(
                f"graph {path.name!r} is {size} bytes; a graph with external weights is expected to be smaller"
            )
        data = path.read_bytes()
    except OSError as exc:  # missing, a folder, unreadable
        raise ArtifactError(f"graph {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    out: list[str] = []
    try:
        for number, wire, value in _fields(data):
            if number == 7 and wire == 2:  # ModelProto.graph
                _graph_locations(value, out, 0)
    except ValueError as exc:
        raise ArtifactError(f"graph {path.name!r} is not a readable ONNX protobuf: {exc}") from None
    return out


def check_graph(root: Path, rel: str, what: str) -> Path:
    """The graph's path after checking it and every external-data file it names (relative to the
    graph's own folder, as ONNX Runtime reads them) stay inside the artifact."""
    path = confined(root, rel, what)
    folder = PurePosixPath(rel).parent
    for location in external_data_locations(path):
        inner = location if folder == PurePosixPath(".") else f"{folder}/{location}"
        if ".." in PurePosixPath(location).parts or PurePosixPath(location).is_absolute():
            raise PathError(f"{what} {rel!r} names external data {location!r} outside the artifact folder")
        confined(root, inner, f"{what} {rel!r} external data")
    return path


__all__ = ["PathError", "check_graph", "confined", "external_data_locations"]
