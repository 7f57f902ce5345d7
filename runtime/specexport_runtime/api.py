"""Public entry point: `load(artifact)` returns a SpecGenerator.

gen = load("artifacts/smollm2-135m")                  # gen.config: the manifest's defaults
gen.generate("def fib(n):", max_new_tokens=64)        # per-call overrides of gen.config
gen.generate(prompt, config=gen.config.replace(proposer="ngram", gamma=4))
run = gen.events(prompt)                              # per round; run.stats is this run's
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import registry
from .adaptive import GammaController
from .batch import DEFAULT_PREFILL_CHUNK, BatchScheduler
from .batch_gamma import BatchGamma
from .config import ADAPTIVE, GeneratorConfig
from .costs import VerifyCost
from .datastore import Datastore
from .eagle_tree import HeadTree
from .engine import OrtModel, SessionConfig
from .errors import ArtifactError, InvalidArgument
from .generator import (
    Generation,
    GenerationResult,
    GenerationStats,
    SpeculativeLoop,
    run_generation,
    validate_prompt_ids,
)
from .manifest import Manifest, ModelEntry, read_manifest, verify_files
from .model import Model
from .paths import check_graph, confined
from .prefix_cache import PrefixCache
from .proposers import Proposer, ProposerContext
from .seeded import stream_for
from .signing import verify as verify_signature
from .slots import SlotModel, idle_rows, too_few_slots
from .structured import ConstraintEngine, Grammar, Guide
from .system_prompt import StoredPrompt
from .tokenizer import TextCodec
from .tools import ToolPlan
from .tree_model import TreeVerifier

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
    """Holds the sessions and KV buffers of one artifact (allocated once) and generates.

    `config` (a GeneratorConfig) is the default of every call; a call passes its own (`config=`)
    and/or overrides of single fields as keyword arguments. What proposers learn across calls
    (the gamma controllers, the suffix store of earlier answers) lives here too."""

    def __init__(
        self,
        root: Path,
        manifest: Manifest,
        codec: TextCodec,
        target: Model,
        draft: Model | None,
        calibration: dict | None = None,
        config: GeneratorConfig | None = None,
        slots: SlotModel | None = None,
        draft_slots: SlotModel | None = None,
        tree: TreeVerifier | None = None,
        head_tree: HeadTree | None = None,
    ):
        """slots: the artifact's batch graph (contract 1.5), when loaded with batch=True; the
        target is then its slot 0 and batch() / scheduler() run several sequences at once.
        tree: the target's tree graph on its cache (contract 1.7), for config.tree_nodes > 0;
        head_tree: an EAGLE-3 head's tree graph on the head's cache (contract 1.8), with which
        the eagle proposer drafts trees."""
        for role, model in (("target", target), ("draft", draft)):
            if model is not None and not isinstance(model, Model):
                raise TypeError(
                    f"the {role} must implement model.Model (OrtModel, TrtModel), got {type(model).__name__}"
                )
        self.root, self.manifest, self.codec = root, manifest, codec
        self.target, self.draft, self.calibration = target, draft, calibration or {}
        self.slots, self.draft_slots = slots, draft_slots  # batch graphs (load(..., batch=True))
        self.tree, self.head_tree = tree, head_tree
        self._batch_gamma: BatchGamma | None = None
        self.eos = set(manifest.tokenizer.eos_token_ids)
        self._draft_kind = None if draft is None else draft.spec.kind
        self._config = self.check(config if config is not None else GeneratorConfig.from_manifest(manifest))
        # one controller per (proposer, domain, controller settings), kept between calls: its
        # costs are the machine's, its acceptance the pair's, and its on/off state and probe
        # back-off carry on
        self._controllers: dict[tuple, GammaController] = {}
        self.verify_cost = VerifyCost()  # the target's call costs: every controller and the suffix tuner read it
        self._learned: dict[str, Any] = {}  # proposer name -> its state across requests (registry `learns`)
        self._d2t: np.ndarray | None = None  # an EAGLE-3 head's vocabulary map, read on first use
        self._datastore: Datastore | None = None
        self._constraints: ConstraintEngine | None = None
        draft_class = getattr(manifest.draft, "exactness", None)
        self.prefix_cache = PrefixCache(target, draft, self._config.prefix_cache_bytes, draft_class)  # prefix_cache.py
        self.prefix_cache.stored = StoredPrompt.of(root, manifest)  # a system prompt built into the artifact

    # --- configuration ------------------------------------------------------------------
    @property
    def config(self) -> GeneratorConfig:
        """The default of every call (the manifest's defaults and load()'s config)."""
        return self._config

    @property
    def default_proposer(self) -> str:
        return self._config.proposer

    def configure(self, config: GeneratorConfig | None = None, **overrides: Any) -> GeneratorConfig:
        """A call's config: `config` (default: self.config) with `overrides`, checked against
        this artifact."""
        return self.check((config if config is not None else self._config).replace(**overrides))

    def check(self, config: GeneratorConfig) -> GeneratorConfig:
        """`config` if this artifact runs its proposer, else InvalidArgument saying why."""
        if not isinstance(config, GeneratorConfig):
            raise TypeError(f"config must be a GeneratorConfig, got {type(config).__name__}")
        if config.speculating:
            self.resolve_proposer(config.proposer)
        if config.tree_nodes and self.tree is None:
            raise InvalidArgument(
                f"tree_nodes {config.tree_nodes} needs the target's tree graph: an artifact built with"
                " tree_verify, loaded without batch=True on the CPU provider"
            )
        return config

    def resolve_proposer(self, name: str | None) -> str:
        """`name` (None: the default) checked against this artifact: a registered proposer whose
        draft graph, if it needs one, the artifact has."""
        name = name or self.default_proposer
        registry.check_available(name, self._draft_kind)
        return name

    # --- proposers ----------------------------------------------------------------------
    def build_proposer(self, name: str, config: GeneratorConfig, context: ProposerContext | None = None) -> Proposer:
        """A fresh proposer `name` for one call (registry factory); context: the models it drafts
        on (default: the generator's target and draft; a batched loop passes its slots')."""
        spec = registry.check_available(name, self._draft_kind)
        base = context or ProposerContext(self.target, self.draft, self.manifest, config, self)
        context = replace(base, config=config, corpus=spec.corpus)
        proposer = registry.resolve(spec.factory)(context)
        if not isinstance(proposer, Proposer) or proposer.name != name:
            raise TypeError(f"the factory of proposer {name!r} returned {proposer!r}, not a Proposer named {name!r}")
        return proposer

    def learned(self, name: str) -> Any:
        """What proposer `name` learns across this generator's calls (created on first use from
        the generator's config), e.g. learned("suffix").store, the answers of earlier calls."""
        if name not in self._learned:
            spec = registry.get(name)
            if spec.learns is None:
                raise InvalidArgument(f"proposer {name!r} keeps nothing across requests")
            self._learned[name] = registry.resolve(spec.learns)(self._config)
        return self._learned[name]

    def forget_history(self) -> None:
        """Forget what proposers learned from earlier answers (e.g. the suffix store, between
        unrelated benchmark runs); what they measured of the target is kept."""
        for state in self._learned.values():
            state.forget()

    @property
    def datastore(self) -> Datastore | None:
        """The artifact's corpus datastore (manifest retrieval), memory-mapped on first use."""
        entry = self.manifest.retrieval
        if entry is not None and self._datastore is None:
            self._datastore = Datastore.open(self.root / entry.tokens, self.root / entry.suffix_array)
        return self._datastore

    def vocab_map(self) -> np.ndarray:
        """The head's draft row -> target id map (manifest draft.vocab_map), read once."""
        if self._d2t is None:
            path = self.root / self.manifest.draft.vocab_map
            try:
                d2t = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise ArtifactError(
                    f"{self.manifest.draft.vocab_map!r} is not a readable .npy vocabulary map: {exc}"
                ) from exc
            rows = self.manifest.target.embedding_rows
            if (
                d2t.dtype != np.int64
                or d2t.shape != (self.draft.spec.embedding_rows,)
                or d2t.min() < 0
                or d2t.max() >= rows
            ):
                raise ArtifactError(
                    f"{self.manifest.draft.vocab_map!r} must hold {self.draft.spec.embedding_rows} int64"
                    f" target ids in [0, {rows}), got {d2t.dtype} {list(d2t.shape)}"
                )
            self._d2t = d2t
        return self._d2t

    def _controller(self, proposer: str, config: GeneratorConfig) -> GammaController:
        key = (proposer, config.domain, config.controller_key)
        if key not in self._controllers:
            self._controllers[key] = self._new_controller(proposer, config)
        return self._controllers[key]

    def _new_controller(self, proposer: str, config: GeneratorConfig) -> GammaController:
        start, off, alpha = config.initial_gamma, False, 0.6
        source = registry.calibration_name(proposer, self._draft_kind)  # hybrid: its draft side's
        entry = calibration_entry(self.calibration, config.domain, source) if source else None
        if entry and entry.get("gamma") is not None:
            g = int(entry["gamma"])
            start, off = (g, False) if g > 0 else (1, True)  # 0 = calibrated "do not speculate"
            alpha = min(1.0, max(0.0, float(entry.get("alpha", alpha))))
        gamma_max = max(config.max_gamma, start)  # a calibrated start may lie above it
        ctl = GammaController(gamma_max=gamma_max, gamma=start, alpha=alpha, cost=self.verify_cost, **config.controller)
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

    def _start(self, prompt_ids: list[int], config: GeneratorConfig) -> Generation:
        """Everything is checked and built here; the rounds run as the Generation is iterated."""
        loop, ctl = self.make_loop(config)
        rounds = self.prefix_cache.run(loop, config, prompt_ids, self._rounds(loop, prompt_ids, config, ctl))
        return Generation(rounds, loop.stats, config, config.gamma_policy, loop.logprobs)

    def make_loop(
        self, config: GeneratorConfig, target: Model | None = None, batched: bool = False, draft: Model | None = None
    ) -> tuple[SpeculativeLoop, GammaController | None]:
        """One generation's speculative loop on `target` and `draft` (default: the generator's)
        and its gamma controller (None: a fixed gamma or none); batched: its target and draft calls
        go through a batch driver (batch.py), which picks every round's gamma itself."""
        context = ProposerContext(
            target if target is not None else self.target,
            draft if draft is not None else self.draft,
            self.manifest,
            config,
            self,
            batched=batched,
        )
        prop = self.build_proposer(config.proposer if config.speculating else registry.NONE, config, context)
        policy, ctl, gamma = config.gamma_policy, None, config.gamma
        if config.speculating and gamma is None and not batched:
            if policy == ADAPTIVE:
                ctl = self._controller(prop.name, config)
            else:  # seeded sampling or a non-adaptive artifact: the calibrated (or manifest) start, fixed;
                # adaptive gamma follows wall-clock costs, which would change a seeded run's random draws
                start = self._new_controller(prop.name, config)
                gamma = start.gamma if start.speculating else None
        guide = Guide(self.constraints().matcher(config.grammar)) if config.grammar is not None else None
        loop = SpeculativeLoop(
            target if target is not None else self.target,
            prop,
            ctl,
            replace(config, gamma=gamma),
            stream_for(config.seed, config.temperature, config.seeded_noise),
            GenerationStats(),
            self.verify_cost,
            guide,
            registry.get(prop.name).free,
            batched,
            None if batched or target is not None else self.tree,
        )
        return loop, ctl

    def constraints(self) -> ConstraintEngine:
        """The artifact's grammar engine (structured.py), built on first use (about a second for
        a large vocabulary): llguidance's view of tokenizer.json."""
        if self._constraints is None:
            text = (self.root / self.manifest.tokenizer.file).read_text(encoding="utf-8")
            self._constraints = ConstraintEngine(text, self.manifest.target.embedding_rows, sorted(self.eos))
        return self._constraints

    def _rounds(self, loop: SpeculativeLoop, prompt_ids: list[int], config: GeneratorConfig, ctl):
        if ctl is not None:
            ctl.start_sequence()
        output: list[int] = []
        for event in run_generation(loop, self.codec, prompt_ids, config, self.eos, self.manifest.max_context):
            output += event[0]
            yield event
        loop.proposer.finish(output)  # reached only when the generation ran to its end (not an abandoned one)

    def events(self, prompt: Prompt, config: GeneratorConfig | None = None, **overrides: Any) -> Generation:
        """The generation behind generate and stream, round by round: a Generation yielding (new
        token ids, new text, finish reason or None) per speculative round, with its own `stats`.
        The prompt and the config are checked now; closing it early abandons the generation
        after the round in progress (a proposer that learns across requests then learns nothing
        from it). config: GeneratorConfig (default: self.config); overrides: its fields."""
        ids = self._prompt_ids(prompt)
        return self._start(ids, self.configure(config, **overrides))

    def generate(self, prompt: Prompt, config: GeneratorConfig | None = None, **overrides: Any) -> GenerationResult:
        """Generate from a prompt (text, UTF-8 bytes or token ids). config / overrides as in
        events: max_new_tokens, temperature, top_k, top_p, seed, stop, proposer (registry.names()),
        gamma (None: the gamma policy), speculative, domain, min_draft_prob, ... (config.py)."""
        return self.events(prompt, config, **overrides).collect()

    def stream(self, prompt: Prompt, config: GeneratorConfig | None = None, **overrides: Any) -> Iterator[str]:
        """Yield text pieces as tokens are accepted (never a split multi-byte character)."""
        return self.events(prompt, config, **overrides).pieces()

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        stream: bool = False,
        config: GeneratorConfig | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        **overrides: Any,
    ):
        """Apply the artifact's chat template (no transformers), then generate (a GenerationResult
        whose tool_calls holds the calls the answer made) or stream text pieces. tools /
        tool_choice / parallel_tool_calls: OpenAI's (tools.py); the answer is then constrained to
        tool calls (one when parallel_tool_calls is False) or, with tool_choice 'auto', plain
        content."""
        prepared = self.prepare_chat(messages, tools, tool_choice, parallel_tool_calls)
        ids = validate_prompt_ids(prepared.ids, self.manifest.target.embedding_rows, self.manifest.max_context)
        if prepared.grammar is not None:
            if overrides.get("grammar") is not None or (config is not None and config.grammar is not None):
                raise InvalidArgument("grammar and tools cannot be combined: tools constrain the answer themselves")
            overrides["grammar"] = prepared.grammar
        run = self._start(ids, self.configure(config, **overrides))
        if stream:
            return run.pieces()
        result = run.collect()
        content, calls = prepared.plan.parse(result.text)
        return replace(result, tool_calls=calls)

    def scheduler(self, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_running: int | None = None) -> BatchScheduler:
        """A continuous-batching scheduler over the artifact's batch graph (batch.py): submit()
        requests, step() rounds; at most max_running sequences at once (default: max_batch).
        Needs load(..., batch=True) on an artifact built with max_batch > 1."""
        if self.slots is None:
            raise InvalidArgument(
                "batched generation needs the artifact's batch graph: build with max_batch > 1 and"
                f" load with batch=True (this artifact's max_batch is {self.manifest.target.max_batch})"
            )
        if self._batch_gamma is None:  # one per generator: the batch call's costs and each proposer's record
            self._batch_gamma = BatchGamma(min(self._config.max_gamma, self.slots.max_rows - 1))
        return BatchScheduler(self, self.slots, prefill_chunk, max_running, self._batch_gamma, self.draft_slots)

    def batch(
        self, prompts: Sequence[Prompt], config: GeneratorConfig | None = None, **overrides: Any
    ) -> list[GenerationResult]:
        """Generate every prompt, up to max_batch at once with continuous batching; each result
        is what generate() gives for that prompt alone (greedy: the same tokens), in prompt order."""
        scheduler = self.scheduler()
        seqs = [scheduler.submit(p, config, **overrides) for p in prompts]
        scheduler.run()
        return [s.result() for s in seqs]

    def prepare_chat(
        self, messages: Sequence[Mapping[str, Any]], tools=None, tool_choice=None, parallel_tool_calls: bool = True
    ) -> PreparedChat:
        """The prompt ids of a conversation (not checked against the context yet) and, with tools,
        its ToolPlan and answer grammar; tools.ToolError names a bad tool field."""
        plan = ToolPlan.create(tools, tool_choice, self.codec.reads_tools, parallel_tool_calls)
        ids = self.codec.encode_chat(plan.messages(messages), tools=plan.template_tools)
        return PreparedChat(ids, plan, plan.grammar())


@dataclass(frozen=True)
class PreparedChat:
    ids: list[int]
    plan: ToolPlan
    grammar: Grammar | None


def load(
    artifact: str | Path,
    provider: str = "cpu",
    threads: int | None = None,
    verify: bool = True,
    shared_pool: bool = False,
    trusted_keys: Sequence[str | Path | bytes] | None = None,
    config: GeneratorConfig | Mapping[str, Any] | None = None,
    batch: bool = False,
    prepack: bool = True,
) -> SpecGenerator:
    """Open an artifact: check manifest, contract version and checksums, create both sessions
    and allocate their KV buffers at max context.

    threads: intra-op threads (None: all cores). shared_pool: on CPU, target and draft share
    one process-wide thread pool (faster on few cores, but every other ONNX Runtime session of
    the process must then join it; see engine.SessionConfig); False (default) gives each
    session its own pool, with spinning off for the target when a draft shares the cores.

    trusted_keys: ed25519 public keys (PEM paths or bytes); when given, the artifact must carry a
    manifest.sig by one of them (signing.py), checked before anything else, and its checksums are
    verified whatever `verify` says (the signature covers the files through them).

    config: the generator's default GeneratorConfig, or a mapping of overrides of the manifest's
    defaults (e.g. {"suffix": SuffixConfig(...), "proposer": "ngram"}); checked against the
    artifact before any session is created.

    batch: load the target's batch graph (an artifact built with max_batch > 1, contract 1.5)
    instead of its batch-1 graph: one session for max_batch sequences (batch(), scheduler()),
    its slot 0 serving generate() and the rest.

    prepack (CPU): False keeps ONNX Runtime from repacking the weights per session; the sessions
    then map the weights files and share their pages (about half the resident memory of the
    default recipe, at about 0.75x its decode speed on the development CPU), and a verify call's
    rows equal one-row calls numerically, not bit for bit, whatever the manifest's class says
    (docs/trees.md)."""
    root = Path(artifact)
    if trusted_keys is not None:
        verify_signature(root, trusted_keys)
        verify = True
    manifest, codec, calibration = open_artifact(root, verify)
    if not isinstance(config, GeneratorConfig):
        config = GeneratorConfig.from_manifest(manifest, **dict(config or {}))
    if config.speculating:  # the same check as SpecGenerator.check, before the slow part
        registry.check_available(config.proposer, manifest.draft_kind)
    has_draft = manifest.draft is not None
    base = SessionConfig(provider=provider, threads=threads, shared_pool=shared_pool, prepack=prepack)
    target_config = replace(base, spinning=not has_draft)
    if batch:  # spinning as for a lone session unless the draft's batch graph shares the cores
        if manifest.target.max_batch < 2:
            raise too_few_slots(root, manifest.target.max_batch, 4)  # batch=True: any number of slots > 1
        target_config = replace(base, spinning=not (has_draft and manifest.draft.max_batch > 1))
    target, slots = _open_graph(root, manifest, manifest.target, "target", target_config, batch)
    tree = None
    if manifest.target.tree_graph and not batch and provider == "cpu":  # its cache: the batch-1 graph's
        graph = check_graph(root, manifest.target.tree_graph, "target tree graph")
        tree = TreeVerifier(graph, target, target_config)
    draft = draft_slots = None
    if has_draft:  # the draft's batch graph when it has one, its slot 0 serving batch-1 calls
        draft, draft_slots = _open_graph(
            root, manifest, manifest.draft, "draft", base, batch and manifest.draft.max_batch > 1
        )
    head_tree = None
    if tree is not None and draft is not None and manifest.draft.tree_graph:  # on the head's cache
        head_tree = HeadTree(check_graph(root, manifest.draft.tree_graph, "draft tree graph"), draft, base)
    return SpecGenerator(root, manifest, codec, target, draft, calibration, config, slots, draft_slots, tree, head_tree)


def _open_graph(
    root: Path, manifest: Manifest, entry: ModelEntry, role: str, config: SessionConfig, batch: bool
) -> tuple[Model, SlotModel | None]:
    """One manifest entry's graph on ONNX Runtime: its batch graph with slot 0 as the Model
    (batch), or its batch-1 graph."""
    if not batch:
        graph = check_graph(root, entry.graph, f"{role} graph")
        model = OrtModel(
            graph, entry.graph_spec(), manifest.max_context, config, min_rows=entry.min_rows, cache_pad=entry.cache_pad
        )
        return model, None
    slots = SlotModel(
        check_graph(root, entry.batch_graph, f"{role} batch graph"),
        entry.graph_spec(slots=entry.max_batch),
        manifest.max_context,
        config,
        max_rows=manifest.max_gamma + 1,
        cache_pad=entry.cache_pad,
        min_rows=entry.min_rows,
        idle_rows=idle_rows(manifest.contract_version),
    )
    return slots.view(0), slots


def open_artifact(root: Path, verify: bool = True) -> tuple[Manifest, TextCodec, dict | None]:
    """Manifest (checksums verified), tokenizer/chat template and calibration of an artifact:
    everything but the models, shared by every backend."""
    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest, lazy=True)  # a stored system prompt's files: on first use
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
