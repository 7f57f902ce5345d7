"""GeneratorConfig: how a SpecGenerator generates, validated once, frozen.

Built from an artifact's manifest defaults (`from_manifest`) plus per-call overrides
(`replace`), and checked at construction: a bad value raises InvalidArgument naming the field,
the value and what was expected, before any model call. The CLI, bench, calibrate, the server
and the Python API all hand one to the generator; nothing configures a SpecGenerator by
setting its attributes.

Gamma policy (`gamma_policy`), in order:
    off                       the proposer is 'none' or speculative is False: target only
    fixed                     gamma is given: every round drafts up to gamma tokens
    fixed (seeded sampling)   sampling with a seed and seeded_noise False (rejection sampling from
                              the seed's stream): the controller's starting gamma (calibrated,
                              else initial_gamma), fixed, so that a seed reproduces the draws
                              whatever the machine's timings. With seeded_noise (the default) a
                              seeded output does not depend on gamma, and the policy is adaptive
    fixed (artifact)          the artifact was built with `speculation.adaptive: false`: the
                              starting gamma as above, fixed
    adaptive                  adaptive.GammaController picks gamma each round from measured
                              acceptance and costs, starting from the calibrated gamma

Tree size (`tree_nodes`; the generation's `tree_policy`, policy.DraftPolicy.tree_nodes):
    given                     tree_nodes is an integer (0: chains): it applies
    calibrated                tree_nodes is None, the artifact has a tree graph and calibration.json
                              holds a tree size for the call's domain and proposer: that size
    chains                    otherwise (no tree graph, a batch, a grammar, a repetition penalty,
                              no calibrated size): 0
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from . import registry
from .adaptive import GammaController
from .constants import (
    DEFAULT_GAMMA,
    DEFAULT_HYBRID_RETRIEVAL,
    DEFAULT_MAX_GAMMA,
    DEFAULT_NGRAM_SIZES,
    HYBRID_RETRIEVALS,
    MAX_GAMMA,
    MAX_NGRAM,
    MAX_TREE_NODES,
    MIN_GAMMA,
)
from .drafts import SuffixConfig
from .errors import InvalidArgument
from .penalties import check_penalty
from .sampling import MAX_TOP_LOGPROBS, SamplingParams
from .structured import Grammar

OFF, FIXED, SEEDED, ARTIFACT, ADAPTIVE = "off", "fixed", "fixed (seeded sampling)", "fixed (artifact)", "adaptive"
# GammaController fields the generator sets itself (from the config and the calibration)
_CONTROLLER_OWN = ("gamma", "gamma_max", "alpha", "cost")


def _int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _fail(name: str, value: Any, expected: str) -> InvalidArgument:
    return InvalidArgument(f"{name} must be {expected}, got {value!r}")


@dataclass(frozen=True)
class GeneratorConfig:
    # what drafts, and how much
    proposer: str = "draft"  # a registered proposer (registry.py); 'none' = target only
    speculative: bool = True  # False: target only, whatever the proposer
    gamma: int | None = None  # fixed draft length; None: the gamma policy (module docstring)
    adaptive: bool = True  # the artifact's speculation.adaptive: False fixes gamma at its start
    initial_gamma: int = DEFAULT_GAMMA  # the controller's start without calibration (manifest speculation.gamma)
    max_gamma: int = DEFAULT_MAX_GAMMA  # the controller's ceiling and prompt lookup's longest draft
    min_draft_prob: float = 0.0  # a draft model ends its round when its top probability falls below (0 = never)
    domain: str | None = None  # calibration domain the controller starts from
    # what is generated
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None: fresh entropy
    # with a seed: per-position noise (seeded.py), the same tokens with any proposer, gamma or batch;
    # False: rejection sampling from the seed's stream (reproducible for the same proposer and gamma)
    seeded_noise: bool = True
    min_p: float = 0.0  # keep tokens with at least min_p x the top probability (0 = off; sampling.py)
    repetition_penalty: float = 1.0  # on the target's rows before verification (1 = off; penalties.py)
    stop: tuple[str, ...] = ()  # a str is read as one stop string
    grammar: Grammar | None = None  # constrained decoding (structured.py; the `structured` extra)
    logprobs: int | None = None  # report each emitted token's log-probability and this many alternatives (0..20)
    # proposer settings
    ngram_sizes: tuple[int, ...] = DEFAULT_NGRAM_SIZES  # prompt lookup, longest tried first
    hybrid_retrieval: str = DEFAULT_HYBRID_RETRIEVAL  # constants.HYBRID_RETRIEVALS
    suffix: SuffixConfig = SuffixConfig()  # global_tokens sizes the generator's store: read from load()'s config
    use_datastore: bool = True  # suffix drafts also come from the artifact's corpus datastore, if any
    # drafts are trees of up to this many tokens (a tree graph); 0: chains; None: the calibrated size
    # for the call's domain and proposer where the artifact has a tree graph, else chains (policy.py)
    tree_nodes: int | None = None
    controller: Mapping[str, Any] = field(default_factory=dict)  # further GammaController fields (e.g. gamma_tolerance)
    # prefix reuse (prefix_cache.py): whether this call reuses and leaves cached prompt rows, the
    # namespace its prefixes match in (e.g. an API key), and the pool's byte bound (read from
    # load()'s config; None: the size of the target's and draft's caches; 0: no pool)
    cache_prompt: bool = True
    cache_salt: str | None = None
    prefix_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        registry.get(self.proposer)  # a registered name (InvalidArgument naming the known ones)
        for name in ("speculative", "adaptive", "use_datastore", "cache_prompt", "seeded_noise"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "true or false")
        if self.gamma is not None and (not _int(self.gamma) or not MIN_GAMMA <= self.gamma <= MAX_GAMMA):
            raise _fail("gamma", self.gamma, f"an integer in {MIN_GAMMA}..{MAX_GAMMA} or None (adaptive)")
        if not _int(self.max_gamma) or not MIN_GAMMA <= self.max_gamma <= MAX_GAMMA:
            raise _fail("max_gamma", self.max_gamma, f"an integer in {MIN_GAMMA}..{MAX_GAMMA}")
        if not _int(self.initial_gamma) or not MIN_GAMMA <= self.initial_gamma <= self.max_gamma:
            raise _fail("initial_gamma", self.initial_gamma, f"an integer in {MIN_GAMMA}..{self.max_gamma} (max_gamma)")
        p = self.min_draft_prob
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not math.isfinite(p) or not 0.0 <= p < 1.0:
            raise _fail("min_draft_prob", p, "a number in [0, 1)")
        if self.domain is not None and not isinstance(self.domain, str):
            raise _fail("domain", self.domain, "a calibration domain name or None")
        if not _int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise _fail("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        self.sampling  # noqa: B018 (SamplingParams' own checks)
        object.__setattr__(self, "repetition_penalty", check_penalty(self.repetition_penalty))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise _fail(
                "grammar",
                self.grammar,
                "a structured.Grammar (Grammar.json_schema(...), .regex, .lark, .json_object())",
            )
        if self.logprobs is not None and (not _int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise _fail(
                "logprobs", self.logprobs, f"None or an integer in 0..{MAX_TOP_LOGPROBS} (alternatives per token)"
            )
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or any(not isinstance(s, str) or not s for s in stop):
            raise _fail("stop", self.stop, "non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise _fail("cache_salt", self.cache_salt, "a string or None (prefixes match within one salt)")
        bound = self.prefix_cache_bytes
        if bound is not None and (not _int(bound) or bound < 0):
            raise _fail("prefix_cache_bytes", bound, "an integer >= 0 (bytes; 0: no prefix pool) or None (default)")
        self._check_proposer_settings()
        self._check_controller()

    def _check_proposer_settings(self) -> None:
        sizes = self.ngram_sizes
        if (
            not isinstance(sizes, (tuple, list))
            or not sizes
            or len(set(sizes)) != len(sizes)
            or any(not _int(n) or not 1 <= n <= MAX_NGRAM for n in sizes)
        ):
            raise _fail("ngram_sizes", sizes, f"distinct integers in 1..{MAX_NGRAM}, at least one")
        object.__setattr__(self, "ngram_sizes", tuple(int(n) for n in sizes))
        if self.hybrid_retrieval not in HYBRID_RETRIEVALS:
            raise InvalidArgument(
                f"hybrid_retrieval must be one of {', '.join(HYBRID_RETRIEVALS)}, got {self.hybrid_retrieval!r}"
            )
        if not isinstance(self.suffix, SuffixConfig):
            raise _fail("suffix", self.suffix, "a suffix.SuffixConfig")
        nodes = self.tree_nodes
        if nodes is not None and (not _int(nodes) or not 0 <= nodes <= MAX_TREE_NODES):
            raise _fail("tree_nodes", nodes, f"an integer in 0..{MAX_TREE_NODES} (0: chains) or None (calibrated)")
        if self.tree_nodes and self.repetition_penalty != 1.0:
            raise InvalidArgument(
                "tree_nodes > 0 with a repetition_penalty: penalized rows are verified as chains; use tree_nodes 0"
            )
        if self.tree_nodes and self.grammar is not None:
            raise InvalidArgument(
                "tree_nodes > 0 with a grammar: constrained decoding verifies chains; use tree_nodes 0"
            )

    def _check_controller(self) -> None:
        if not isinstance(self.controller, Mapping):
            raise _fail("controller", self.controller, "a mapping of GammaController fields")
        options = dict(self.controller)
        known = [f.name for f in fields(GammaController) if f.init and f.name not in _CONTROLLER_OWN]
        for key in options:
            if key not in known:
                raise InvalidArgument(
                    f"controller option {key!r} is not one of {', '.join(known)}"
                    f" ({', '.join(_CONTROLLER_OWN)} come from the config and the calibration)"
                )
        GammaController(gamma_max=self.max_gamma, gamma=self.initial_gamma, **options)  # its own checks
        object.__setattr__(self, "controller", MappingProxyType(options))

    # --- construction --------------------------------------------------------------------
    @classmethod
    def from_manifest(cls, manifest, **overrides: Any) -> GeneratorConfig:
        """The artifact's defaults (speculation and generation sections) with `overrides`."""
        spec = manifest.speculation
        base = cls(
            proposer=spec.proposer,
            initial_gamma=spec.gamma,
            max_gamma=manifest.max_gamma,
            adaptive=manifest.adaptive,
            ngram_sizes=spec.ngram_sizes,
            hybrid_retrieval=spec.hybrid_retrieval,
        )
        return base.replace(**overrides)

    def replace(self, **overrides: Any) -> GeneratorConfig:
        """A validated copy with `overrides` (field names; proposer=None keeps the proposer)."""
        known = {f.name for f in fields(self)}
        for key in overrides:
            if key not in known:
                raise InvalidArgument(f"unknown generation setting {key!r}; known: {', '.join(sorted(known))}")
        if "proposer" in overrides and overrides["proposer"] is None:
            del overrides["proposer"]
        return replace(self, **overrides) if overrides else self

    # --- derived ---------------------------------------------------------------------------
    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed, self.min_p)

    @property
    def speculating(self) -> bool:
        """Whether a proposer drafts (False: target only)."""
        return self.speculative and registry.get(self.proposer).speculative

    @property
    def gamma_policy(self) -> str:
        """How gamma is chosen (module docstring)."""
        return self.policy_given(self.speculating)

    def policy_given(self, proposer_drafts: bool) -> str:
        """gamma_policy, with whether the proposer's registry entry drafts already known."""
        if not (self.speculative and proposer_drafts):
            return OFF
        if self.gamma is not None:
            return FIXED
        if self.seed is not None and self.temperature > 0 and not self.seeded_noise:
            return SEEDED
        return ADAPTIVE if self.adaptive else ARTIFACT

    @property
    def controller_key(self) -> tuple:
        """What distinguishes the controllers of two calls with the same proposer and domain."""
        return self.initial_gamma, self.max_gamma, tuple(sorted(self.controller.items()))


__all__ = ["ADAPTIVE", "ARTIFACT", "FIXED", "OFF", "SEEDED", "GeneratorConfig"]
