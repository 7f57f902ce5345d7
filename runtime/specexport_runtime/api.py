"""Public entry point: `load(artifact)` returns a SpecGenerator.

gen = load("artifacts/smollm2-135m")                  # gen.config: the manifest's defaults
gen.generate("def fib(n):", max_new_tokens=64)        # per-call overrides of gen.config
gen.generate(prompt, config=gen.config.replace(proposer="ngram", gamma=4))
run = gen.events(prompt)                              # per round; run.stats is this run's
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import registry
from .batch import DEFAULT_PREFILL_CHUNK, BatchScheduler
from .config import GeneratorConfig
from .constants import ONNXRUNTIME
from .costs import VerifyCost
from .datastore import Datastore
from .eagle_tree import HeadTree
from .engine import SessionConfig
from .errors import InvalidArgument
from .generator import Generation, GenerationResult, LoopSetup, SpeculativeLoop, run_generation, validate_prompt_ids
from .loading import CALIBRATION_NAME as CALIBRATION_NAME  # public here: calibrate.py, tests
from .loading import check_backend, import_backend, open_artifact, open_models
from .manifest import Manifest
from .model import Model
from .policy import DraftPolicy, calibration_entry  # noqa: F401 (calibration_entry: api's since calibrate reads it)
from .prefix_cache import PrefixCache
from .proposers import Proposer, ProposerContext, build_proposer
from .registry import ProposerSpec
from .seeded import stream_for
from .services import ProposerServices
from .signing import verify as verify_signature
from .slots import SlotModel
from .structured import ConstraintEngine, Grammar, Guide
from .system_prompt import StoredPrompt
from .tokenizer import TextCodec
from .tools import ToolPlan
from .tree_model import TreeVerifier

Prompt = str | bytes | Sequence[int]


class SpecGenerator:
    """Holds the sessions and KV buffers of one artifact (allocated once) and generates.

    `config` (a GeneratorConfig) is the default of every call; a call passes its own (`config=`)
    and/or overrides of single fields as keyword arguments. What proposers learn across calls
    (the draft-length policy, the suffix store of earlier answers) lives here too. Built from
    keywords only (load() builds it)."""

    def __init__(
        self,
        *,
        root: Path,
        manifest: Manifest,
        codec: TextCodec,
        target: Model,
        draft: Model | None = None,
        calibration: dict | None = None,
        config: GeneratorConfig | None = None,
        slots: SlotModel | None = None,
        draft_slots: SlotModel | None = None,
        tree: TreeVerifier | None = None,
        head_tree: HeadTree | None = None,
    ):
        """slots: the artifact's batch graph (feature cache_slots), when loaded with batch=True; the
        target is then its slot 0 and batch() / scheduler() run several sequences at once.
        tree: the target's tree graph on its cache (feature tree_verify), for config.tree_nodes > 0;
        head_tree: an EAGLE-3 head's tree graph on the head's cache (feature eagle3_head_tree), with which
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
        self.eos = set(manifest.tokenizer.eos_token_ids)
        self._draft_kind = None if draft is None else draft.spec.kind
        self._config = self.check(config if config is not None else GeneratorConfig.from_manifest(manifest))
        self.policy = DraftPolicy(self.calibration, self._draft_kind)  # every round's draft length
        draft_rows = None if draft is None else draft.spec.embedding_rows
        self.services = ProposerServices(root, manifest, self._config, self.policy.cost, draft_rows, head_tree)
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
        return self.configured(config, **overrides)[0]

    def configured(
        self, config: GeneratorConfig | None = None, **overrides: Any
    ) -> tuple[GeneratorConfig, ProposerSpec]:
        """configure(), and the registry entry the call runs, resolved once for its generation."""
        return self.checked((config if config is not None else self._config).replace(**overrides))

    def check(self, config: GeneratorConfig) -> GeneratorConfig:
        """`config` if this artifact runs its proposer, else InvalidArgument saying why."""
        return self.checked(config)[0]

    def checked(self, config: GeneratorConfig) -> tuple[GeneratorConfig, ProposerSpec]:
        """check(), and the registry entry the call runs ('none' when it does not speculate)."""
        if not isinstance(config, GeneratorConfig):
            raise TypeError(f"config must be a GeneratorConfig, got {type(config).__name__}")
        spec = self.proposer_spec(config)
        if config.tree_nodes and self.tree is None:
            raise InvalidArgument(
                f"tree_nodes {config.tree_nodes} needs the target's tree graph: an artifact built with"
                " tree_verify, loaded without batch=True on the CPU provider"
            )
        return config, spec

    def resolve_proposer(self, name: str | None) -> str:
        """`name` (None: the default) checked against this artifact: a registered proposer whose
        draft graph, if it needs one, the artifact has."""
        name = name or self.default_proposer
        registry.check_available(name, self._draft_kind)
        return name

    # --- proposers ---------------------------------------------------------------------
    @property
    def verify_cost(self) -> VerifyCost:
        """The target's call costs (the draft-length policy's cost model, timed by the loops)."""
        return self.policy.cost

    def proposer_spec(self, config: GeneratorConfig) -> ProposerSpec:
        """The registry entry a call with `config` runs ('none' when it does not speculate),
        checked against this artifact: resolved once per generation and carried."""
        name = config.proposer if config.speculative else registry.NONE
        return registry.check_available(name, self._draft_kind)

    def build_proposer(
        self,
        name: str | ProposerSpec,
        config: GeneratorConfig,
        target: Model | None = None,
        draft: Model | None = None,
        batched: bool = False,
    ) -> Proposer:
        """A fresh proposer (registry factory) for one call, drafting on `target` and `draft`
        (default: the generator's; a batched loop passes its slots')."""
        spec = name if isinstance(name, ProposerSpec) else registry.check_available(name, self._draft_kind)
        context = ProposerContext(
            target if target is not None else self.target,
            draft if draft is not None else self.draft,
            self.manifest,
            config,
            spec,
            self.services,
            batched,
        )
        return build_proposer(context, spec)

    def learned(self, name: str) -> Any:
        """What proposer `name` learns across this generator's calls (created on first use from
        the generator's config), e.g. learned("suffix").store, the answers of earlier calls."""
        return self.services.learned(name)

    def forget_history(self) -> None:
        """Forget what proposers learned from earlier answers (e.g. the suffix store, between
        unrelated benchmark runs); what they measured of the target is kept."""
        self.services.forget()

    @property
    def datastore(self) -> Datastore | None:
        """The artifact's corpus datastore (manifest retrieval), memory-mapped on first use."""
        return self.services.datastore()

    def vocab_map(self) -> np.ndarray:
        """The head's draft row -> target id map (manifest draft.vocab_map), read once."""
        return self.services.vocab_map()

    # --- generation ---------------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, (str, bytes)):
            ids = self.codec.encode(prompt)
        else:
            ids = list(prompt)
        return validate_prompt_ids(ids, self.manifest.target.embedding_rows, self.manifest.max_context)

    def _start(self, prompt_ids: list[int], config: GeneratorConfig, spec: ProposerSpec) -> Generation:
        """Everything is checked and built here; the rounds run as the Generation is iterated."""
        config, tree_policy = self.with_tree_nodes(config, spec)
        loop = self.make_loop(config, spec)
        rounds = self.prefix_cache.run(loop, config, prompt_ids, self._rounds(loop, prompt_ids, config))
        gamma_policy = config.policy_given(spec.speculative)
        return Generation(rounds, loop.stats, config, gamma_policy, loop.logprobs, tree_policy)

    def with_tree_nodes(
        self, config: GeneratorConfig, spec: ProposerSpec, batched: bool = False
    ) -> tuple[GeneratorConfig, str]:
        """`config` with its tree size decided for one generation (None: calibrated or chains;
        policy.DraftPolicy.tree_nodes), and where the size came from."""
        n, origin = self.policy.tree_nodes(spec, config, self.tree is not None and not batched)
        return (config if config.tree_nodes == n else config.replace(tree_nodes=n)), origin

    def make_loop(
        self,
        config: GeneratorConfig,
        spec: ProposerSpec | None = None,
        target: Model | None = None,
        batched: bool = False,
        draft: Model | None = None,
    ) -> SpeculativeLoop:
        """One generation's speculative loop on `target` and `draft` (default: the generator's),
        running the registry entry `spec` (default: resolved from config); its gamma is the
        policy's (batched: the batch driver's, batch.py)."""
        spec = spec if spec is not None else self.proposer_spec(config)
        if config.tree_nodes is None:  # a batch's or a caller's loop: decided here (_start decides its own)
            config = self.with_tree_nodes(config, spec, batched or target is not None)[0]
        guide = Guide(self.constraints().matcher(config.grammar)) if config.grammar is not None else None
        setup = LoopSetup(
            target=target if target is not None else self.target,
            proposer=self.build_proposer(spec, config, target, draft, batched),
            config=config,
            rng=stream_for(config.seed, config.temperature, config.seeded_noise),
            spec=spec,
            policy=self.policy.for_generation(spec, config, batched),
            guide=guide,
            batched=batched,
            tree=None if batched or target is not None else self.tree,
        )
        return SpeculativeLoop(setup)

    def constraints(self) -> ConstraintEngine:
        """The artifact's grammar engine (structured.py), built on first use (about a second for
        a large vocabulary): llguidance's view of tokenizer.json."""
        if self._constraints is None:
            text = (self.root / self.manifest.tokenizer.file).read_text(encoding="utf-8")
            self._constraints = ConstraintEngine(text, self.manifest.target.embedding_rows, sorted(self.eos))
        return self._constraints

    def _rounds(self, loop: SpeculativeLoop, prompt_ids: list[int], config: GeneratorConfig):
        loop.policy.start()
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
        return self._start(ids, *self.configured(config, **overrides))

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
        run = self._start(ids, *self.configured(config, **overrides))
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
        gamma = self.policy.batch(min(self._config.max_gamma, self.slots.max_rows - 1))
        return BatchScheduler(self, self.slots, prefill_chunk, max_running, gamma, self.draft_slots)

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
    backend: str = ONNXRUNTIME,
    device_id: int = 0,
) -> SpecGenerator:
    """Open an artifact: check manifest, contract version and checksums, create both models
    and allocate their KV buffers at max context.

    backend: "onnxruntime" (default: ONNX Runtime sessions on `provider`) or "tensorrt" (the
    native backend, trt_backend.py: the engines `python -m specexport_runtime.trt_build` wrote
    for this GPU; batch-1 graphs and chains only, so batch=True and a config with tree_nodes > 0
    are refused, as are provider, threads and prepack other than their defaults). Both go
    through the same signature, checksum, config and proposer checks (loading.py).
    device_id: the CUDA device of the cuda / tensorrt providers and of the "tensorrt" backend.

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

    batch: load the target's batch graph (an artifact built with max_batch > 1, feature cache_slots)
    instead of its batch-1 graph: one session for max_batch sequences (batch(), scheduler()),
    its slot 0 serving generate() and the rest.

    prepack (CPU): False keeps ONNX Runtime from repacking the weights per session; the sessions
    then map the weights files and share their pages (about half the resident memory of the
    default recipe, at about 0.75x its decode speed on the development CPU), and a verify call's
    rows equal one-row calls numerically, not bit for bit, whatever the manifest's class says
    (docs/trees.md)."""
    asked = config.tree_nodes if isinstance(config, GeneratorConfig) else dict(config or {}).get("tree_nodes", 0)
    check_backend(backend, batch=batch, tree_nodes=asked, provider=provider, threads=threads, prepack=prepack)
    base = SessionConfig(
        provider=provider, threads=threads, shared_pool=shared_pool, prepack=prepack, device_id=device_id
    )
    import_backend(backend)  # a missing TensorRT fails before the artifact is hashed
    root = Path(artifact)
    if trusted_keys is not None:
        verify_signature(root, trusted_keys)
        verify = True
    manifest, codec, calibration = open_artifact(root, verify)
    if not isinstance(config, GeneratorConfig):
        config = GeneratorConfig.from_manifest(manifest, **dict(config or {}))
    if config.speculating:  # the same check as SpecGenerator.check, before the slow part
        registry.check_available(config.proposer, manifest.draft_kind)
    models = open_models(root, manifest, backend, base, batch)
    return SpecGenerator(
        root=root,
        manifest=manifest,
        codec=codec,
        target=models.target,
        draft=models.draft,
        calibration=calibration,
        config=config,
        slots=models.slots,
        draft_slots=models.draft_slots,
        tree=models.tree,
        head_tree=models.head_tree,
    )
