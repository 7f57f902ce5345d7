"""Public entry point: `load(artifact)` returns a SpecGenerator."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .adaptive import GammaController
from .datastore import Datastore
from .eagle import EagleProposer
from .engine import OrtModel, SessionConfig
from .errors import ArtifactError, InvalidArgument
from .generator import (
    GenerateOptions,
    GenerationResult,
    GenerationStats,
    SpeculativeLoop,
    run_generation,
    validate_prompt_ids,
)
from .manifest import (
    DEFAULT_HYBRID_RETRIEVAL,
    DRAFT_MODEL_PROPOSERS,
    HEAD_PROPOSERS,
    HYBRID_RETRIEVALS,
    PROPOSERS,
    SPECULATIVE_PROPOSERS,
    Manifest,
    read_manifest,
    verify_files,
)
from .paths import check_graph, confined
from .signing import verify as verify_signature
from .proposers import (
    DraftModelProposer,
    HybridProposer,
    NgramLookupProposer,
    NoProposer,
    Proposer,
)
from .sampling import SamplingParams
from .suffix import LimitTuner, SourceCalibration, SuffixConfig, SuffixProposer, SuffixStore
from .tokenizer import TextCodec

Prompt = str | bytes | Sequence[int]
CALIBRATION_NAME = "calibration.json"


def calibration_entry(doc: dict, domain: str | None, proposer: str, profile: str | None = None) -> dict | None:
    """calibration.json (specexport calibrate): profile (default: default_profile) -> domain
    (falling back to 'default') -> proposer; None when absent."""
    if "profiles" in doc:
        doc = doc["profiles"].get(profile or doc.get("default_profile") or "", {})
    domains = doc.get("domains") or {}
    return (domains.get(domain or "default") or domains.get("default") or {}).get(proposer)


class SpecGenerator:
    """Holds the sessions and KV buffers of one artifact (allocated once) and generates."""

    def __init__(self, root: Path, manifest: Manifest, codec: TextCodec, target: OrtModel, draft: OrtModel | None,
                 calibration: dict | None = None):
        self.root, self.manifest, self.codec = root, manifest, codec
        self.target, self.draft, self.calibration = target, draft, calibration or {}
        self.eos = set(manifest.tokenizer.eos_token_ids)
        # one controller per (proposer, domain), kept between calls: its costs are the machine's,
        # its acceptance the pair's, and its on/off state and probe back-off carry on
        self._controllers: dict[tuple[str, str | None], GammaController] = {}
        # further GammaController fields (e.g. gamma_tolerance, probe_every) for the controllers
        # created from now on; checked by GammaController, so a bad value fails at the next generate
        self.controller_options: dict[str, Any] = {}
        self.last_stats: GenerationStats | None = None
        self._d2t: np.ndarray | None = None  # an EAGLE-3 head's vocabulary map, read on first use
        # the suffix proposer's settings and its store of past responses (accepted output of the
        # requests that finished), kept between calls: later requests draft from earlier answers
        self.suffix_config = SuffixConfig()
        self.suffix_store = SuffixStore(self.suffix_config.global_tokens)
        # what `hybrid` retrieves with besides its draft: "suffix" (suffix drafts from the request
        # and earlier answers where they score, then lookup; the default: docs/proposers.md) or
        # "lookup" (n-gram prompt lookup only)
        self.hybrid_retrieval = DEFAULT_HYBRID_RETRIEVAL
        self.suffix_calibration = SourceCalibration()  # per-source score calibration, learned across requests
        self.suffix_tuner = LimitTuner()  # which suffix draft limit pays on this target, learned across requests
        self.use_datastore = True  # the suffix proposer also drafts from the artifact's corpus datastore, if any
        self._datastore: Datastore | None = None

    # --- proposers ----------------------------------------------------------------------
    @property
    def default_proposer(self) -> str:
        return self.manifest.speculation.proposer

    def resolve_proposer(self, name: str | None) -> str:
        """`name` (None: the artifact's default) checked against this artifact: a known proposer,
        and one that needs a draft model only when the artifact has one."""
        name = name or self.default_proposer
        if name not in PROPOSERS:
            raise InvalidArgument(f"proposer {name!r} is not one of {', '.join(map(repr, PROPOSERS))}")
        if name not in SPECULATIVE_PROPOSERS or name in self.manifest.speculative_proposers():
            return name
        if self.draft is None:
            raise InvalidArgument(f"proposer {name!r} needs an artifact with a draft model; this one has none (use 'ngram')")
        if name in HEAD_PROPOSERS:
            raise InvalidArgument(f"proposer {name!r} needs an artifact with an EAGLE-3 draft head; this one has a draft"
                                  " model (use 'draft' or 'hybrid')")
        raise InvalidArgument("proposer 'draft' needs a draft model; this artifact's draft is an EAGLE-3 head"
                              " (use 'eagle' or 'hybrid')")

    def _proposer(self, name: str | None, min_draft_prob: float = 0.0) -> Proposer:
        name = self.resolve_proposer(name)
        if name in DRAFT_MODEL_PROPOSERS:
            if not 0.0 <= min_draft_prob < 1.0:
                raise InvalidArgument(f"min_draft_prob must be in [0, 1), got {min_draft_prob!r}")
            if self.draft.spec.is_head:
                draft = EagleProposer(self.draft, self.target, self._vocab_map(), self.manifest.target.embedding_rows)
            else:
                draft = DraftModelProposer(self.draft, self.manifest.target.embedding_rows, min_draft_prob)
            if name in ("draft", "eagle"):
                return draft
            if self.hybrid_retrieval not in HYBRID_RETRIEVALS:
                raise InvalidArgument(f"hybrid_retrieval must be one of {', '.join(HYBRID_RETRIEVALS)}, got {self.hybrid_retrieval!r}")
            suffix = self._suffix() if self.hybrid_retrieval == "suffix" else None
            return HybridProposer(draft, self._lookup(), suffix=suffix)
        if name == "ngram":
            return self._lookup()
        if name == "suffix":
            return self._suffix()
        return NoProposer()

    def _suffix(self) -> SuffixProposer:
        return SuffixProposer(self.suffix_store, self.suffix_config, self.manifest.max_context,
                              self.datastore if self.use_datastore else None, self.suffix_calibration,
                              self.suffix_tuner)

    @property
    def datastore(self) -> Datastore | None:
        """The artifact's corpus datastore (manifest retrieval), memory-mapped on first use."""
        entry = self.manifest.retrieval
        if entry is not None and self._datastore is None:
            self._datastore = Datastore.open(self.root / entry.tokens, self.root / entry.suffix_array)
        return self._datastore

    def forget_history(self) -> None:
        """Empty the suffix proposer's store of past responses (e.g. between unrelated benchmark runs)."""
        self.suffix_store = SuffixStore(self.suffix_config.global_tokens)

    def _vocab_map(self) -> np.ndarray:
        """The head's draft row -> target id map (manifest draft.vocab_map), read once."""
        if self._d2t is None:
            path = self.root / self.manifest.draft.vocab_map
            try:
                d2t = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise ArtifactError(f"{self.manifest.draft.vocab_map!r} is not a readable .npy vocabulary map: {exc}") from exc
            rows = self.manifest.target.embedding_rows
            if d2t.dtype != np.int64 or d2t.shape != (self.draft.spec.embedding_rows,) or d2t.min() < 0 or d2t.max() >= rows:
                raise ArtifactError(f"{self.manifest.draft.vocab_map!r} must hold {self.draft.spec.embedding_rows} int64"
                                    f" target ids in [0, {rows}), got {d2t.dtype} {list(d2t.shape)}")
            self._d2t = d2t
        return self._d2t

    def _lookup(self) -> NgramLookupProposer:
        return NgramLookupProposer(self.manifest.speculation.ngram_sizes, self.manifest.max_gamma)

    def _controller(self, proposer: str, domain: str | None) -> GammaController:
        key = (proposer, domain)
        if key not in self._controllers:
            self._controllers[key] = self._new_controller(proposer, domain)
        return self._controllers[key]

    def _new_controller(self, proposer: str, domain: str | None) -> GammaController:
        start, off, alpha = self.manifest.speculation.gamma, False, 0.6
        # a hybrid's controller only sees its draft-model rounds: start from the draft's calibration
        draft_side = "eagle" if self.draft is not None and self.draft.spec.is_head else "draft"
        entry = calibration_entry(self.calibration, domain, draft_side if proposer == "hybrid" else proposer)
        if entry and entry.get("gamma") is not None:
            g = int(entry["gamma"])
            start, off = (g, False) if g > 0 else (1, True)  # 0 = calibrated "do not speculate"
            alpha = min(1.0, max(0.0, float(entry.get("alpha", alpha))))
        gamma_max = max(self.manifest.max_gamma, start)  # a calibrated start may lie above it
        ctl = GammaController(gamma_max=gamma_max, gamma=start, alpha=alpha, **self.controller_options)
        if off:
            ctl.speculating = False  # starts off; probes may still switch it on
        return ctl

    # --- generation ---------------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, (str, bytes)):
            ids = self.codec.encode(prompt)
        else:
            ids = list(prompt)
        return validate_prompt_ids(ids, self.manifest.target.embedding_rows, self.manifest.max_context)

    def _events(self, prompt_ids: list[int], *, max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                gamma=None, proposer=None, stop=(), speculative=True, domain=None, min_draft_prob=0.0):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        options = GenerateOptions(max_new_tokens, params, gamma, speculative, stop)
        prop = self._proposer(proposer if speculative else "none", min_draft_prob)
        ctl = None
        if speculative and gamma is None:
            if seed is not None and not params.greedy:
                # adaptive gamma follows wall-clock costs, which would change the random draws: a
                # seeded sampling run uses the calibrated/manifest starting gamma, fixed, to be reproducible
                start = self._new_controller(prop.name, domain)
                options = replace(options, gamma=start.gamma if start.speculating else None)
            else:
                ctl = self._controller(prop.name, domain)
                ctl.start_sequence()
        stats = GenerationStats()
        self.last_stats = stats
        loop = SpeculativeLoop(self.target, prop, ctl, options, np.random.default_rng(seed), stats)
        output: list[int] = []
        for event in run_generation(loop, self.codec, prompt_ids, options, self.eos, self.manifest.max_context):
            output += event[0]
            yield event
        finish = getattr(prop, "finish", None)  # optional: proposers that learn across requests
        if finish is not None:  # reached only when the generation ran to its end (not an abandoned stream)
            finish(output)

    def generate(self, prompt: Prompt, **kwargs) -> GenerationResult:
        """Generate from a prompt (text, UTF-8 bytes or token ids). Keyword arguments:
        max_new_tokens, temperature, top_k, top_p, seed, gamma (None = adaptive), proposer
        ('draft' | 'ngram' | 'hybrid' (retrieval when the text repeats, else the draft: hybrid_retrieval) | 'eagle' | 'suffix' (suffix
        matches in this request and in earlier answers) | 'none'), stop (strings), speculative, domain (calibration profile),
        min_draft_prob (stop a draft round when the draft's top probability falls below it)."""
        return self._collect(self._prompt_ids(prompt), kwargs)

    def events(self, prompt: Prompt, **kwargs) -> Iterator[tuple[list[int], str, str | None]]:
        """The per-round iterator behind generate and stream: yields (new token ids, new text,
        finish reason or None) once per speculative round; the same keyword arguments as generate.
        The prompt is checked now, the other arguments on the first next(); `last_stats` is this
        generation's from then on. Closing the iterator early abandons the generation after the
        round in progress (a proposer that learns across requests then learns nothing from it)."""
        return self._events(self._prompt_ids(prompt), **kwargs)

    def stream(self, prompt: Prompt, **kwargs) -> Iterator[str]:
        """Yield text pieces as tokens are accepted (never a split multi-byte character)."""
        for _, piece, _ in self._events(self._prompt_ids(prompt), **kwargs):
            if piece:
                yield piece

    def chat(self, messages: Sequence[Mapping[str, str]], stream: bool = False, **kwargs):
        """Apply the artifact's chat template (no transformers), then generate or stream."""
        ids = validate_prompt_ids(self.codec.encode_chat(messages), self.manifest.target.embedding_rows, self.manifest.max_context)
        if stream:
            return (piece for _, piece, _ in self._events(ids, **kwargs) if piece)
        return self._collect(ids, kwargs)

    def _collect(self, ids: list[int], kwargs: dict) -> GenerationResult:
        tokens: list[int] = []
        text: list[str] = []
        reason = "length"
        for new, piece, why in self._events(ids, **kwargs):
            tokens += new
            text.append(piece)
            reason = why or reason
        return GenerationResult(tokens, "".join(text), reason, self.last_stats)


def load(artifact: str | Path, provider: str = "cpu", threads: int | None = None, verify: bool = True,
         shared_pool: bool = False, trusted_keys: Sequence[str | Path | bytes] | None = None) -> SpecGenerator:
    """Open an artifact: check manifest, contract version and checksums, create both sessions
    and allocate their KV buffers at max context.

    threads: intra-op threads (None: all cores). shared_pool: on CPU, target and draft share
    one process-wide thread pool (faster on few cores, but every other ONNX Runtime session of
    the process must then join it; see engine.SessionConfig); False (default) gives each
    session its own pool, with spinning off for the target when a draft shares the cores.

    trusted_keys: ed25519 public keys (PEM paths or bytes); when given, the artifact must carry a
    manifest.sig by one of them (signing.py), checked before anything else, and its checksums are
    verified whatever `verify` says (the signature covers the files through them)."""
    root = Path(artifact)
    if trusted_keys is not None:
        verify_signature(root, trusted_keys)
        verify = True
    manifest, codec, calibration = open_artifact(root, verify)
    has_draft = manifest.draft is not None
    base = SessionConfig(provider=provider, threads=threads, shared_pool=shared_pool)
    target_config = replace(base, spinning=not has_draft)
    target = OrtModel(check_graph(root, manifest.target.graph, "target graph"), manifest.target.graph_spec(),
                      manifest.max_context, target_config,
                      min_rows=manifest.target.min_rows, cache_pad=manifest.target.cache_pad)
    draft = None
    if has_draft:
        draft = OrtModel(check_graph(root, manifest.draft.graph, "draft graph"), manifest.draft.graph_spec(),
                         manifest.max_context, base,
                         min_rows=manifest.draft.min_rows, cache_pad=manifest.draft.cache_pad)
    return SpecGenerator(root, manifest, codec, target, draft, calibration)


def open_artifact(root: Path, verify: bool = True) -> tuple[Manifest, TextCodec, dict | None]:
    """Manifest (checksums verified), tokenizer/chat template and calibration of an artifact:
    everything but the models, shared by every backend."""
    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest)
    tok = manifest.tokenizer
    template = (root / tok.chat_template).read_text(encoding="utf-8") if tok.chat_template else None
    vocab = json.loads((root / tok.file).read_text(encoding="utf-8"))
    eos_text = bos_text = None
    for added in vocab.get("added_tokens", []):
        if added["id"] in tok.eos_token_ids and eos_text is None:
            eos_text = added["content"]
        if tok.bos_token_id is not None and added["id"] == tok.bos_token_id:
            bos_text = added["content"]
    codec = TextCodec(root / tok.file, template, bos=bos_text, eos=eos_text)
    calibration = None
    if confined(root, CALIBRATION_NAME, "calibration file").is_file():  # a symlink leaving the folder is refused
        try:
            calibration = json.loads((root / CALIBRATION_NAME).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{CALIBRATION_NAME} is not valid JSON: {exc}") from exc
    return manifest, codec, calibration
