"""The draft-length policy: how many tokens each round drafts, for one sequence or a batch.

One DraftPolicy per generator decides every round's draft from one cost model, the target's
costs.VerifyCost (its batch-1 line and its batch graph's plane), timed by the loops. Its
strategies read that model, pacing's named constants and pacing.ProbeClock (the one probe /
recheck mechanism); each keeps the acceptance record of what it decides:

    one sequence   adaptive.GammaController: gamma from the acceptance and the costs, off when
                   speculation does not pay, probes while off (one per proposer, domain and
                   controller settings, kept across requests; started from calibration.json)
    a batch        batch_gamma.BatchGamma: one gamma for the batch, and its guard against what
                   whole rounds realize; the longest free draft of a batch round (free_limit)
    free suffix    suffix_limit.LimitTuner: the scale of the suffix draft limit (the suffix
      drafts       proposer asks it through SuffixHistory; priced by the same VerifyCost)

Each generation gets a RoundDraft, the one thing its loop asks: gamma() once a round. In order:
    not speculating                  -> 0
    a fixed gamma (the call's, or a non-adaptive policy's start)  -> it
    in a batch                       -> the batch's gamma for this round (assign)
    a controller                     -> controller.choose()
"""

from __future__ import annotations

from dataclasses import dataclass

from . import registry
from .adaptive import GammaController
from .batch_gamma import BatchGamma
from .config import ADAPTIVE, GeneratorConfig
from .constants import MAX_TREE_NODES
from .costs import VerifyCost
from .registry import ProposerSpec

# where a generation's tree size came from (config.py "Tree size")
TREE_GIVEN, TREE_CALIBRATED, TREE_CHAINS = "given", "calibrated", "chains"


def calibration_entry(doc: dict, domain: str | None, proposer: str, profile: str | None = None) -> dict | None:
    """calibration.json (specexport calibrate): profile (default: default_profile) -> domain
    (falling back to 'default') -> proposer; None when absent."""
    if "profiles" in doc:
        doc = doc["profiles"].get(profile or doc.get("default_profile") or "", {})
    domains = doc.get("domains") or {}
    return (domains.get(domain or "default") or domains.get("default") or {}).get(proposer)


@dataclass
class RoundDraft:
    """One generation's draft length, round by round (module docstring). `cost`: the target's
    cost model the loop times its solo calls into (a batched loop's calls are the batch's)."""

    speculating: bool
    fixed: int | None = None  # every round drafts up to this many tokens
    controller: GammaController | None = None
    cost: VerifyCost | None = None  # None: the controller's, else a fresh one
    batched: bool = False
    assigned: int | None = None  # in a batch: this round's gamma (BatchGamma.choose)
    free_limit: int = 0  # in a batch: most tokens a free draft may hold this round (BatchGamma.free_limit)

    def __post_init__(self) -> None:
        if self.cost is None:
            self.cost = self.controller.cost if self.controller is not None else VerifyCost()

    @classmethod
    def of(cls, config: GeneratorConfig, controller: GammaController | None = None) -> RoundDraft:
        """The call's own gamma (config.gamma), or the controller's choice."""
        return cls(config.speculating, config.gamma, controller)

    def gamma(self) -> int:
        if not self.speculating:
            return 0
        if self.fixed is not None:
            return self.fixed
        if self.assigned is not None:
            return self.assigned
        return self.controller.choose() if self.controller is not None else 0

    def free_cap(self) -> int:
        """Most tokens a free draft may hold in a batch round (0 with a fixed gamma: it caps them)."""
        return self.free_limit if self.fixed is None else 0

    def assign(self, gamma: int, free_limit: int) -> int | None:
        """The batch's gamma and free-draft limit for the next round; returns the last round's."""
        used, self.assigned, self.free_limit = self.assigned, gamma, free_limit
        return used

    def start(self) -> None:
        if self.controller is not None:
            self.controller.start_sequence()

    def timed(self, rows: int, seconds: float) -> None:
        """A solo target call of `rows` rows took `seconds` (the first, cold call is not timed)."""
        if seconds > 0 and not self.batched:
            self.cost.record(rows, seconds)

    @property
    def learns(self) -> bool:
        """Whether verified drafts teach it anything (an adaptive controller's acceptance and costs)."""
        return self.controller is not None

    def drafted(self, depth: int, accepted: int, draft_seconds: float) -> None:
        """A verified model draft (not a free one, forced tokens apart): `depth` positions
        drafted, `accepted` of them accepted, in draft_seconds (its catch-up excluded)."""
        if self.controller is not None and depth > 0:
            self.controller.record_round(depth, accepted, draft_seconds)


class DraftPolicy:
    """The generator's draft-length policy (module docstring): its cost model, its controllers
    and its batch strategy, kept across requests."""

    def __init__(self, calibration: dict | None = None, draft_kind: str | None = None):
        self.calibration, self.draft_kind = calibration or {}, draft_kind
        self.cost = VerifyCost()  # the target's call costs: every strategy reads it
        # one controller per (proposer, domain, controller settings), kept between calls: its
        # costs are the machine's, its acceptance the pair's, and its on/off state and probe
        # back-off carry on
        self.controllers: dict[tuple, GammaController] = {}
        self._batch: BatchGamma | None = None

    def controller(self, spec: ProposerSpec, config: GeneratorConfig) -> GammaController:
        key = (spec.name, config.domain, config.controller_key)
        if key not in self.controllers:
            self.controllers[key] = self.starting(spec, config)
        return self.controllers[key]

    def starting(self, spec: ProposerSpec, config: GeneratorConfig) -> GammaController:
        """A fresh controller at its start: the calibrated gamma and acceptance of the proposer
        (hybrid: its draft side's), else config.initial_gamma; a calibrated 0 starts it off."""
        start, off, alpha = config.initial_gamma, False, 0.6
        source = registry.calibration_of(spec, self.draft_kind)
        entry = calibration_entry(self.calibration, config.domain, source) if source else None
        if entry and entry.get("gamma") is not None:
            g = int(entry["gamma"])
            start, off = (g, False) if g > 0 else (1, True)  # 0 = calibrated "do not speculate"
            alpha = min(1.0, max(0.0, float(entry.get("alpha", alpha))))
        gamma_max = max(config.max_gamma, start)  # a calibrated start may lie above it
        ctl = GammaController(gamma_max=gamma_max, gamma=start, alpha=alpha, cost=self.cost, **config.controller)
        if off:
            ctl.speculating = False  # starts off; probes may still switch it on
        return ctl

    def tree_nodes(self, spec: ProposerSpec, config: GeneratorConfig, tree_graph: bool) -> tuple[int, str]:
        """(tree_nodes, origin) of a generation (config.py "Tree size"): the call's own when given;
        else, where trees can run (`tree_graph`: the target's tree graph verifies this
        generation's rounds, i.e. not in a batch), the calibrated size of (domain, the proposer
        that runs: its own entry, not its draft side's) when calibration.json holds one; else 0."""
        if config.tree_nodes is not None:
            return config.tree_nodes, TREE_GIVEN
        if not (tree_graph and config.speculating) or config.grammar is not None or config.repetition_penalty != 1.0:
            return 0, TREE_CHAINS
        entry = calibration_entry(self.calibration, config.domain, spec.name) or {}
        n = entry.get("tree_nodes")  # absent: the calibration measured no trees
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TREE_NODES:
            return 0, TREE_CHAINS
        return n, TREE_CALIBRATED

    def batch(self, gamma_max: int) -> BatchGamma:
        """The batch strategy (one per generator: the batch call's costs and each proposer's record)."""
        if self._batch is None:
            self._batch = BatchGamma(gamma_max, cost=self.cost)
        return self._batch

    def for_generation(self, spec: ProposerSpec, config: GeneratorConfig, batched: bool = False) -> RoundDraft:
        """A generation's RoundDraft. Adaptive: the controller's choice; seeded sampling or a
        non-adaptive artifact: the controller's start, fixed (adaptive gamma follows wall-clock
        costs, which would change a seeded run's random draws); in a batch: the batch's."""
        speculating = config.speculative and spec.speculative
        fixed, ctl = config.gamma, None
        if speculating and fixed is None and not batched:
            if config.policy_given(spec.speculative) == ADAPTIVE:
                ctl = self.controller(spec, config)
            else:
                start = self.starting(spec, config)
                fixed = start.gamma if start.speculating else None
        return RoundDraft(speculating, fixed, ctl, self.cost, batched)
