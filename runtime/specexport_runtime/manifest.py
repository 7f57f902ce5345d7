"""The artifact manifest (docs/artifact.md): typed, written by the build side, read by the runtime.

An artifact is a folder:
    manifest.json            this schema
    tokenizer.json           Hugging Face `tokenizers` file shared by target and draft
    chat_template.jinja      optional
    target/model.onnx (+ model.onnx.data)
    draft/model.onnx  (+ model.onnx.data)   absent for the n-gram proposer
    calibration.json         optional, written by `specexport calibrate`
    system_prompt/           optional, a system prompt's rows (system_prompt.py), read lazily
Every file except manifest.json is listed in `files` with its sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from . import registry
from .constants import DEFAULT_GAMMA, DEFAULT_HYBRID_RETRIEVAL, DEFAULT_MAX_GAMMA, DEFAULT_NGRAM_SIZES, EXACTNESS
from .contract import (
    ASSISTANT,
    CONTRACT_VERSION,
    DECODER,
    DFLASH_BLOCK,
    EAGLE3_HEAD,
    GRAPH_KINDS,
    KV_LAYOUTS,
    MTP,
    TIME_MAJOR,
    GraphSpec,
    is_supported,
    parse_version,
    version_for,
)
from .errors import ArtifactError, ChecksumError, InvalidArgument
from .features import FEATURES, features_for
from .features import unknown as unknown_features
from .paths import confined
from .schema import check_manifest
from .system_prompt import SystemPromptEntry

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # an artifact's name: safe in a path and a config
SIGNATURE_NAME = "manifest.sig"  # signing.py: never listed in files (it signs the manifest that lists them)
MAX_MIN_ROWS = 16


@dataclass(frozen=True)
class ModelEntry:
    """One exported graph and the facts needed to run it."""

    graph: str  # path relative to the artifact root
    source: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # tokenizer vocabulary
    embedding_rows: int  # rows of the logits (>= vocab_size possible)
    precision: str  # fp32 | fp16 | int8 | int4 | dynamic-int8
    kv_dtype: str = "float32"
    validation: dict[str, Any] = field(default_factory=dict)
    kv_layout: str = TIME_MAJOR  # contract layout of the graph (contract.KV_LAYOUTS)
    min_rows: int = 1  # rows every call gets (feature row_padding: padded after the real tokens)
    cache_pad: int = 0  # cache rows past the call the graph itself writes (feature row_padding: padded attention)
    # feature eagle3_head: the target's hidden_states output holds the residual streams entering these
    # layers (output_hidden_states indices), each `feature_width / len(feature_layers)` wide
    feature_layers: tuple[int, ...] = ()
    feature_width: int = 0
    # feature eagle3_head draft heads: kind eagle3_head, its hidden width, and the file (int64 .npy,
    # relative to the artifact root) mapping each draft-vocabulary row to its target id
    kind: str = DECODER
    hidden_width: int = 0
    vocab_map: str | None = None
    # constants.EXACTNESS as measured at build time (validation["rows"]); None: not measured. Written as
    # its own key only for a padded entry (a contract-1.2 artifact anyway), so that 1.0 / 1.1
    # runtimes still read unpadded artifacts; read back from validation["rows"] otherwise.
    exactness: str | None = None
    # feature attention_windows: the distinct GroupQueryAttention windows of a head_major_inplace graph
    attention_windows: tuple[int, ...] = ()
    # feature cache_slots: a slots graph of the same weights serving max_batch sequences per call
    # (relative path; it shares the entry's weights file), for batched generation
    batch_graph: str | None = None
    max_batch: int = 1
    # feature tree_verify: a tree-verify graph of the same weights and cache (relative path; a target's,
    # since 1.8 an EAGLE-3 head's, since 1.9 a time_major target's)
    tree_graph: str | None = None
    # feature recurrent_state: the shape of each recurrent state tensor (a hybrid decoder's conv windows)
    states: tuple[tuple[int, ...], ...] = ()
    # feature dflash_block: a DFlash drafter's block rows (the anchor and block_size - 1 drafts) and mask token
    block_size: int = 0
    mask_token_id: int = -1
    # feature assistant (kind assistant): the target caches n the graph reads (shared_key_{n})
    shared_kv: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch, int) or self.max_batch < 1 or (self.max_batch > 1) != bool(self.batch_graph):
            raise InvalidArgument(
                f"max_batch {self.max_batch!r} with batch_graph {self.batch_graph!r}: expected max_batch 1 without a"
                " batch graph, or max_batch >= 2 with one"
            )

    @property
    def padded(self) -> bool:
        """Whether the entry uses a contract-1.2 padding (calls or attention)."""
        return self.min_rows > 1 or self.cache_pad > 0

    @property
    def required_version(self) -> str:
        """The contract version that defines this entry's layout and fields as built now."""
        return self._version(idle_rows=0)

    @property
    def least_version(self) -> str:
        """The lowest contract version under which this entry is readable (a 1.5 batch graph
        gives idle slots one row)."""
        return self._version(idle_rows=1)

    @property
    def features(self) -> tuple[str, ...]:
        """The graph features this entry needs (features.py), as built now."""
        return features_for(**self._graph_facts(idle_rows=0))

    def _version(self, idle_rows: int) -> str:
        return version_for(**self._graph_facts(idle_rows))

    def _graph_facts(self, idle_rows: int) -> dict[str, Any]:
        """What features_for / version_for read of this entry."""
        return dict(
            kv_layout=self.kv_layout,
            min_rows=2 if self.padded or self.feature_width else 1,
            head=self.kind == EAGLE3_HEAD,
            windowed=bool(self.attention_windows),
            slots=self.max_batch,
            idle_rows=idle_rows,
            tree=bool(self.tree_graph),
            states=bool(self.states),
            dflash=self.kind == DFLASH_BLOCK,
            assistant=self.kind == ASSISTANT,
            mtp=self.kind == MTP,
        )

    def json_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.padded:  # contract-1.2 keys left out (module note above)
            del data["min_rows"], data["cache_pad"], data["exactness"]
        if not self.feature_width:
            del data["feature_layers"], data["feature_width"]
        if self.kind == DECODER:
            del data["kind"], data["hidden_width"], data["vocab_map"]
        if not self.attention_windows:
            del data["attention_windows"]
        if self.max_batch == 1:
            del data["batch_graph"], data["max_batch"]
        if self.tree_graph is None:
            del data["tree_graph"]
        if not self.states:
            del data["states"]
        if self.kind != DFLASH_BLOCK:
            del data["block_size"], data["mask_token_id"]
        if not self.shared_kv:
            del data["shared_kv"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelEntry:
        data = {
            **data,
            "feature_layers": tuple(data.get("feature_layers", ())),
            "attention_windows": tuple(data.get("attention_windows", ())),
            "states": tuple(tuple(int(d) for d in shape) for shape in data.get("states", ())),
            "shared_kv": tuple(data.get("shared_kv", ())),
        }
        entry = cls(**data)
        rows = entry.validation.get("rows") if isinstance(entry.validation, dict) else None
        measured = rows.get("exactness") if isinstance(rows, dict) else None
        if entry.exactness is None and measured is not None:
            entry = replace(entry, exactness=measured)
        return entry

    def graph_spec(self, slots: int = 1, tree: bool = False) -> GraphSpec:
        """The graph's GraphSpec; slots = max_batch: its batch graph's; tree: its tree graph's."""
        return GraphSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            embedding_rows=self.embedding_rows,
            kv_dtype=self.kv_dtype,
            kv_layout=self.kv_layout,
            feature_width=self.feature_width,
            kind=self.kind,
            hidden_width=self.hidden_width,
            windows=self.attention_windows,
            slots=slots,
            tree=tree,
            states=self.states,
            shared_kv=self.shared_kv,
        )


@dataclass(frozen=True)
class TokenizerEntry:
    file: str = "tokenizer.json"
    chat_template: str | None = None  # path of a jinja file relative to the root
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    add_bos: bool = False
    sha256: str = ""


@dataclass(frozen=True)
class RetrievalEntry:
    """A corpus datastore (specexport_runtime/datastore.py): files relative to the root. Older
    1.x runtimes ignore the section (they only lose the datastore drafts, never exactness)."""

    tokens: str  # int32 [N] .npy, documents separated by -1
    suffix_array: str  # [N] .npy, the suffix array of the reversed tokens
    token_count: int
    info: dict[str, Any] = field(default_factory=dict)  # what the build read (files, documents, seconds)


@dataclass(frozen=True)
class SpeculationDefaults:
    proposer: str = "draft"  # a registered proposer (registry.py)
    gamma: int = DEFAULT_GAMMA  # the gamma controller's start
    ngram_sizes: tuple[int, ...] = DEFAULT_NGRAM_SIZES
    # what `hybrid` retrieves with besides its draft (constants.HYBRID_RETRIEVALS); manifests
    # written before the field retrieve with the default
    hybrid_retrieval: str = DEFAULT_HYBRID_RETRIEVAL


@dataclass(frozen=True)
class Manifest:
    name: str
    max_context: int
    target: ModelEntry
    tokenizer: TokenizerEntry
    draft: ModelEntry | None = None
    speculation: SpeculationDefaults = SpeculationDefaults()
    generation: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    tools: dict[str, str] = field(default_factory=dict)
    retrieval: RetrievalEntry | None = None
    contract_version: str = CONTRACT_VERSION
    schema_version: int = SCHEMA_VERSION
    system_prompt: SystemPromptEntry | None = None  # written only when present (older runtimes refuse the key)

    @property
    def max_gamma(self) -> int:
        """Longest draft the runtime proposes (adaptive gamma's ceiling, n-gram lookup's length):
        generation.max_gamma (DEFAULT_MAX_GAMMA when absent), and never below speculation.gamma."""
        return max(int(self.generation.get("max_gamma") or DEFAULT_MAX_GAMMA), self.speculation.gamma)

    @property
    def adaptive(self) -> bool:
        """generation.adaptive (absent: true): False fixes gamma at its start (config.py)."""
        return bool(self.generation.get("adaptive", True))

    @property
    def draft_kind(self) -> str | None:
        """The draft graph's kind (contract.GRAPH_KINDS), None without a draft graph."""
        return None if self.draft is None else self.draft.kind

    def speculative_proposers(self) -> tuple[str, ...]:
        """The drafting proposers this artifact can run (registry.available): the draft-free ones
        always, the others with a draft graph of a kind they run with."""
        return registry.available(self.draft_kind)

    def _check_layouts(self) -> Manifest:
        proposer = self.speculation.proposer
        try:
            spec = registry.get(proposer)
        except InvalidArgument:
            known = ", ".join(registry.names())
            raise ArtifactError(f"speculation.proposer {proposer!r} is not one of {known}") from None
        if spec.uses_draft and self.draft is None:
            raise ArtifactError(f"speculation.proposer {proposer!r} needs a draft graph; the manifest has none")
        for role, entry in (("target", self.target), ("draft", self.draft)):
            if entry is None:
                continue
            if entry.kv_layout not in KV_LAYOUTS:
                raise ArtifactError(f"{role} kv_layout {entry.kv_layout!r} is not one of {KV_LAYOUTS}")
            for key, lo in (("min_rows", 1), ("cache_pad", 0)):
                value = getattr(entry, key)
                if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= MAX_MIN_ROWS:
                    raise ArtifactError(f"{role} {key} {value!r} is not an integer in {lo}..{MAX_MIN_ROWS}")
            if entry.kind == DFLASH_BLOCK and (role != "draft" or entry.block_size < 2 or entry.mask_token_id < 0):
                raise ArtifactError(f"{role} kind {DFLASH_BLOCK!r} is a draft with block_size >= 2 and a mask_token_id")
            head_ok = entry.kind == EAGLE3_HEAD and entry.vocab_map
            if entry.kind not in GRAPH_KINDS or (
                entry.kind != DECODER
                and (role != "draft" or not (head_ok or entry.kind in (ASSISTANT, DFLASH_BLOCK, MTP)))
            ):
                raise ArtifactError(
                    f"{role} kind {entry.kind!r} is not allowed (a {DECODER!r} graph, or a draft"
                    f" {EAGLE3_HEAD!r} with a vocab_map file, or a draft {ASSISTANT!r}, {DFLASH_BLOCK!r} or {MTP!r})"
                )
            if entry.kind == MTP and self.target.feature_width != entry.feature_width:
                raise ArtifactError(
                    f"draft kind 'mtp' reads the target's last hidden rows ({entry.feature_width} wide);"
                    f" the target returns {self.target.feature_width}"
                )
            if entry.kind == ASSISTANT and not self.target.feature_width:
                raise ArtifactError("draft kind 'assistant' reads the target's last hidden rows; the target has none")
            if entry.exactness is not None and entry.exactness not in EXACTNESS:
                raise ArtifactError(f"{role} exactness {entry.exactness!r} is not one of {', '.join(EXACTNESS)}")
            if entry.max_batch > 1 and (entry.kind != DECODER or entry.feature_width):
                raise ArtifactError(
                    f"{role} max_batch {entry.max_batch}: a batch graph belongs to a decoder without features"
                )
            if entry.tree_graph is not None and (
                entry.kind not in ((DECODER,) if role == "target" else (EAGLE3_HEAD, MTP))
                or (role == "draft" and not entry.graph_spec().layout.in_place)
            ):
                raise ArtifactError(
                    f"{role} tree_graph {entry.tree_graph!r}: a tree graph belongs to a target decoder"
                    " (either layout) or a head_major_inplace EAGLE-3 or MTP head"
                )
            if parse_version(entry.least_version) > parse_version(self.contract_version):
                raise ArtifactError(
                    f"{role} kv_layout {entry.kv_layout!r} with min_rows {entry.min_rows},"
                    f" cache_pad {entry.cache_pad} needs contract"
                    f" {entry.least_version}, but the manifest declares {self.contract_version}"
                )
        return self

    def _check_features(self, listed: list[str] | None) -> Manifest:
        """A manifest that lists its graph features lists every one its entries need."""
        missing = sorted(set(self.graph_features) - set(listed or self.graph_features))
        if missing:
            raise ArtifactError(f"manifest graph_features lacks {', '.join(missing)}, which its graphs need")
        return self

    def named_paths(self) -> list[tuple[str, str]]:
        """(what, relative path) of every file the manifest names."""
        out = [("manifest files entry", rel) for rel in self.files]
        for role, entry in (("target", self.target), ("draft", self.draft)):
            if entry is not None:
                out.append((f"{role} graph", entry.graph))
                if entry.batch_graph:
                    out.append((f"{role} batch_graph", entry.batch_graph))
                if entry.tree_graph:
                    out.append((f"{role} tree_graph", entry.tree_graph))
                if entry.vocab_map:
                    out.append((f"{role} vocab_map", entry.vocab_map))
        out.append(("tokenizer file", self.tokenizer.file))
        if self.tokenizer.chat_template:
            out.append(("tokenizer chat_template", self.tokenizer.chat_template))
        if self.retrieval is not None:
            out += [
                ("retrieval tokens", self.retrieval.tokens),
                ("retrieval suffix_array", self.retrieval.suffix_array),
            ]
        if self.system_prompt is not None:
            out += [("system_prompt file", rel) for rel in self.system_prompt.files()]
        return out

    @property
    def graph_features(self) -> list[str]:
        """Every feature the artifact's graphs need, sorted (the manifest's `graph_features`)."""
        return sorted({f for entry in (self.target, self.draft) if entry is not None for f in entry.features})

    def to_json(self) -> str:
        data = asdict(self)
        for role in ("target", "draft"):
            entry = getattr(self, role)
            data[role] = None if entry is None else entry.json_dict()
        data["graph_features"] = self.graph_features
        if self.system_prompt is None:
            del data["system_prompt"]
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        if not isinstance(data, dict):
            raise ArtifactError(f"manifest is a {type(data).__name__}, not a JSON object")
        try:
            schema = data["schema_version"]
            if isinstance(schema, bool) or schema != SCHEMA_VERSION:
                raise ArtifactError(
                    f"manifest schema_version {schema!r} is not supported; this runtime reads {SCHEMA_VERSION}"
                )
            lacking = unknown_features(data.get("graph_features", []))
            if lacking:  # by name, before the version: it says what this runtime lacks
                raise ArtifactError(
                    f"this artifact's graphs need {', '.join(lacking)}, which this specexport-runtime does not"
                    f" implement (it knows {', '.join(sorted(FEATURES))}); upgrade specexport-runtime"
                )
            contract = data["contract_version"]
            if not isinstance(contract, str) or not is_supported(contract):
                raise ArtifactError(
                    f"graph contract {contract!r} is not supported;"
                    f" this runtime reads {CONTRACT_VERSION.split('.')[0]}.x"
                    " (upgrade specexport-runtime or rebuild the artifact)"
                )
            check_manifest(data)  # types, ranges, known keys, sizes: before anything is built from it
            if not NAME_RE.match(data["name"]):  # it names folders (unpack's versions) and Triton models
                raise ArtifactError(
                    f"manifest name {data['name']!r} is not a plain name (letters, digits, '.', '_' and '-', starting"
                    " with a letter or digit, at most 128): this artifact was not written by `specexport build`"
                )
            spec = data.get("speculation") or {}
            tok = data["tokenizer"]
            return (
                cls(
                    name=data["name"],
                    max_context=int(data["max_context"]),
                    target=ModelEntry.from_json(data["target"]),
                    draft=ModelEntry.from_json(data["draft"]) if data.get("draft") else None,
                    tokenizer=TokenizerEntry(**{**tok, "eos_token_ids": tuple(tok.get("eos_token_ids", ()))}),
                    speculation=SpeculationDefaults(
                        **{**spec, "ngram_sizes": tuple(spec.get("ngram_sizes", DEFAULT_NGRAM_SIZES))}
                    ),
                    generation=dict(data.get("generation", {})),
                    files=dict(data.get("files", {})),
                    tools=dict(data.get("tools", {})),
                    retrieval=RetrievalEntry(**data["retrieval"]) if data.get("retrieval") else None,
                    contract_version=contract,
                    schema_version=schema,
                    system_prompt=SystemPromptEntry.from_json(data["system_prompt"])
                    if data.get("system_prompt")
                    else None,
                )
                ._check_layouts()
                ._check_features(data.get("graph_features"))
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"manifest is malformed: {exc!r} (expected schema {SCHEMA_VERSION})") from exc


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def checksum_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root except the manifest, keyed by POSIX relative path."""
    return {
        path.relative_to(root).as_posix(): sha256_file(path)
        for path in sorted(root.rglob("*"))
        if path.is_file()
        and path.relative_to(root).as_posix() not in (MANIFEST_NAME, SIGNATURE_NAME)
        and not _is_temporary(path)
    }


def read_manifest(root: str | Path) -> Manifest:
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"artifact folder {str(root)!r} does not exist (expected a folder from `specexport build`)")
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{str(path)!r} is missing: {str(root)!r} is not a specexport artifact")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    manifest = Manifest.from_dict(data)
    for what, rel in manifest.named_paths():  # before anything else is opened
        confined(root, rel, what)
    return manifest


def verify_files(root: str | Path, manifest: Manifest, lazy: bool = False) -> None:
    """Raise if a listed file is missing or its sha256 differs; unlisted extra files are ignored.
    lazy: leave out the files read and checked on first use (a stored system prompt's rows)."""
    root = Path(root)
    later = set(manifest.system_prompt.files()) if lazy and manifest.system_prompt is not None else set()
    for rel, expected in sorted(manifest.files.items()):
        if rel in later:
            continue
        path = confined(root, rel, "manifest files entry")
        if not path.is_file():
            raise ArtifactError(f"artifact file {rel!r} is missing from {str(root)!r}")
        actual = sha256_file(path)
        if actual != expected:
            raise ChecksumError(
                f"checksum mismatch for {rel!r}: manifest says {expected[:16]}..., file has {actual[:16]}..."
                " (the artifact is truncated or was modified; rebuild it)"
            )


def write_manifest(root: str | Path, manifest: Manifest) -> None:
    """Write manifest.json with `files` recomputed from the folder's current contents; written
    to a temporary file and renamed over the old one, so a reader never sees half a manifest."""
    root = Path(root)
    files = checksum_tree(root)
    data = json.loads(manifest.to_json())
    data["files"] = files
    atomic_write_text(root / MANIFEST_NAME, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _is_temporary(path: Path) -> bool:
    """A file atomic_write_text is writing (or left behind when killed): never checksummed."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, fsync, then rename over `path` (keeping
    the old file's permission bits; new files get 0o666 minus the umask)."""
    if path.exists():
        mode = path.stat().st_mode & 0o777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
