"""`specexport calibrate`: pick the draft length per domain and proposer, store it in the artifact.

Per domain and proposer, greedy generations with a large fixed gamma (the largest asked,
8 by default) observe every draft position of every round: the drafted count k and the
accepted count n of each round (plain steps of a proposer that found nothing count as k = 0).
Drafting the first g of those k tokens would have accepted min(n, g) of them, so for every
candidate g
    E[tokens per target call](g) = mean over rounds of (min(n, g) + 1)
    E[seconds per target call](g) = mean over rounds of  decode               if min(k, g) = 0
                                                         min(k,g)·draft_step + verify(min(k,g)+1) otherwise
    expected speedup(g) = E[tokens](g) · decode / E[seconds](g)
with the costs measured on this machine (median of timed ONNX Runtime calls after a real
prompt, the argmax included; see measure_costs) or given (costs=, which makes the choice
deterministic for tests). The chosen gamma maximises the expected speedup; 0 (no speculation)
when no g beats plain decoding. For a draft model k = gamma always, and the formula is
sum_{i<=g} prod_{j<=i} a_j / (g·c + v(g+1)) with a_j the conditional acceptance by position.

calibration.json (written atomically, its checksum added to manifest.json):
    {"version": 1,
     "default_profile": DEVICE,
     "profiles": {DEVICE: {"measured_at": ISO date, "costs": {...}, "settings": {...},
                           "domains": {DOMAIN | "default": {PROPOSER: {"gamma": g,
                                "expected_speedup": x, "acceptance_by_position": [...], ...}}}}}}
A run on another device name adds a profile beside the existing ones. "default" pools the
rounds of every calibrated domain.
"""

from __future__ import annotations

import json
import os
import platform
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from specexport_runtime import registry
from specexport_runtime.api import CALIBRATION_NAME, calibration_entry, load
from specexport_runtime.constants import MAX_GAMMA, MAX_TREE_NODES, MIN_GAMMA
from specexport_runtime.errors import InvalidArgument, SpecExportError
from specexport_runtime.manifest import MANIFEST_NAME, atomic_write_text, read_manifest, sha256_file

from . import calibrate_trees, harness
from .calibrate_trees import DEFAULT_TREE_NODES, TREE_DRAFTERS
from .harness import Case, load_prompt_set, make_cases, warmup_case
from .prompts import DOMAINS, Prompt
from .run import WARMUP_TOKENS, run_one
from .stats import conditional_acceptance, verify_cost

CALIBRATION_VERSION = 1
DEFAULT_GAMMAS = (1, 2, 3, 4, 6, 8)
TIMING_REPEATS = 7
Progress = Callable[[int, int, str], None]


class CalibrationError(SpecExportError, ValueError):
    """Invalid calibration arguments or an unusable calibration file."""


def default_device_name(provider: str = "cpu") -> str:
    """e.g. 'x86_64-cpu-2cores' (machine, provider, logical cores)."""
    name = f"{platform.machine() or 'unknown'}-{provider}-{os.cpu_count() or 0}cores"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


# --------------------------------------------------------------------------- costs


def measure_costs(gen, ids: Sequence[int], max_s: int, repeats: int = TIMING_REPEATS) -> dict:
    """Median seconds of target calls over S = 1..max_s tokens and of a draft-model step,
    each after the same real prompt prefix (the cache is rolled back after every call; the
    argmax over the returned rows is included, like the loop's host work). Sizes are
    interleaved within each repeat, in an order rotated from repeat to repeat
    (harness.interleaved_seconds), so drift spreads evenly."""
    ids = [int(t) for t in ids]
    if len(ids) + max_s + 1 > gen.manifest.max_context:
        raise CalibrationError(f"the timing prompt ({len(ids)} tokens) leaves no room for {max_s} tokens")
    filler = (ids * (max_s // len(ids) + 1))[:max_s]
    target = gen.target
    target.reset()
    target.forward(ids)
    calls = {s: _timed_call(target, target.length, filler[:s]) for s in range(1, max_s + 1)}
    seconds = harness.interleaved_seconds(calls, repeats)
    target.reset()
    out = {"decode_s": seconds[1], "verify_s": {s: v for s, v in seconds.items() if s > 1}, "draft_step_s": {}}
    if gen.draft is not None and not gen.draft.spec.is_head:  # a head's step is timed in the loop (calibrate)
        draft = gen.draft
        draft.reset()
        draft.forward(ids)
        step = _timed_call(draft, draft.length, filler[:1])
        step()  # warm-up, not timed
        out["draft_step_s"]["draft"] = harness.median_seconds(step, 3 * repeats)
        draft.reset()
    out["method"] = (
        f"median of {repeats} timed calls (argmax included) after a {len(ids)}-token prompt; "
        "n-gram step: lookup seconds per drafted token in the acceptance runs"
    )
    return out


def _timed_call(model, base: int, ids: list[int]) -> Callable[[], None]:
    """One call of `model` over `ids` after its first `base` cached tokens (the cache rolled back
    first, a cursor move), the argmax over the returned rows included."""

    def call() -> None:
        model.truncate(base)
        model.forward(ids, last_rows=len(ids)).argmax(-1)

    return call


def _merge_costs(measured: dict | None, override: dict | None) -> dict:
    out = {"decode_s": None, "verify_s": {}, "draft_step_s": {}, "tree_verify_s": {}, "tree_draft_step_s": {}}
    for src in (measured, override):
        if not src:
            continue
        out["tree_verify_s"].update({int(r): float(v) for r, v in (src.get("tree_verify_s") or {}).items()})
        out["tree_draft_step_s"].update({k: float(v) for k, v in (src.get("tree_draft_step_s") or {}).items()})
        if src.get("decode_s") is not None:
            out["decode_s"] = float(src["decode_s"])
        out["verify_s"].update({int(s): float(v) for s, v in (src.get("verify_s") or {}).items()})
        step = src.get("draft_step_s")
        if isinstance(step, dict):
            out["draft_step_s"].update({k: float(v) for k, v in step.items()})
        elif step is not None:
            out["draft_step_s"] = {"draft": float(step), "ngram": float(step)}
        for key in ("method",):
            if key in src:
                out[key] = src[key]
    if override:
        out["method"] = "given" if not measured else out.get("method", "") + "; overridden in part by the caller"
    return out


def _costs_complete(costs: dict | None, proposers: Sequence[str]) -> bool:
    if not costs or costs.get("decode_s") is None or not costs.get("verify_s"):
        return False
    step = costs.get("draft_step_s")
    return not isinstance(step, dict) or all(p in step for p in proposers)


# --------------------------------------------------------------------------- choice


def expected_speedup(rounds: Sequence[tuple[int, int]], gamma: int, costs: dict, proposer: str) -> float:
    """Expected tokens/s relative to plain decoding when drafting at most `gamma` tokens,
    from rounds (k, n) observed with a larger gamma (module docstring). 1.0 for gamma 0."""
    if gamma == 0 or not rounds:
        return 1.0
    decode, step = costs["decode_s"], costs["draft_step_s"].get(proposer)
    if decode is None or step is None:
        raise CalibrationError(f"costs lack the decode time or the {proposer!r} step time: {costs}")
    tokens = seconds = 0.0
    for k, n in rounds:
        kk = min(k, gamma)
        tokens += min(n, gamma) + 1
        seconds += decode if kk == 0 else kk * step + verify_cost(costs, kk + 1)
    return tokens * decode / seconds


def choose_gamma(rounds: Sequence[tuple[int, int]], gammas: Sequence[int], costs: dict, proposer: str) -> dict:
    by_gamma = {g: expected_speedup(rounds, g, costs, proposer) for g in sorted(gammas)}
    best_g, best = 0, 1.0
    for g, x in by_gamma.items():
        if x > best:
            best_g, best = g, x
    drafted = sum(k for k, _ in rounds)
    accepted = sum(n for _, n in rounds)
    rejected = sum(1 for k, n in rounds if 0 < k and n < k)
    width = max((k for k, _ in rounds), default=0)
    return {
        "gamma": best_g,
        "expected_speedup": best,
        "acceptance_by_position": conditional_acceptance(rounds, width),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "alpha": accepted / (accepted + rejected) if accepted + rejected else 0.0,
        "expected_speedup_by_gamma": {str(g): x for g, x in by_gamma.items()},
        "rounds": len(rounds),
    }


# --------------------------------------------------------------------------- main entry


def calibrate(
    artifact,
    domains: Sequence[str] = DOMAINS,
    proposers: Sequence[str] | None = None,
    gammas: Sequence[int] = DEFAULT_GAMMAS,
    prompts_per_domain: int = 6,
    max_new_tokens: int = 64,
    device_name: str | None = None,
    *,
    costs: dict | None = None,
    prompts: Sequence[Prompt] | None = None,
    threads: int | None = None,
    progress: Progress | None = None,
    set_default: bool = True,
    shared_pool: bool = False,
    write: bool = True,
    tree_nodes: Sequence[int] = DEFAULT_TREE_NODES,
) -> dict:
    """Measure acceptance per domain and costs, choose gamma per domain and proposer, and
    (write=True) store the profile in the artifact's calibration.json. Returns the whole
    calibration document. `prompts` replaces the shipped prompt sets (filtered by `domains`);
    `costs` ({"decode_s", "verify_s": {S: s}, "draft_step_s": {proposer: s} or s}) replaces
    measured costs, entirely when complete (with trees: also "tree_verify_s": {R: s}, and
    optionally "tree_draft_step_s": {proposer: s}). On an artifact with a tree graph the proposers
    that draft trees are also run with each of `tree_nodes` (calibrate_trees.py), and each entry
    gets the tree size with the best expected speedup (0: chains); () measures no trees."""
    gammas = sorted(set(gammas))
    if not gammas or any(
        isinstance(g, bool) or not isinstance(g, int) or not MIN_GAMMA <= g <= MAX_GAMMA for g in gammas
    ):
        raise CalibrationError(f"gammas must be integers in {MIN_GAMMA}..{MAX_GAMMA}, got {gammas}")
    if prompts_per_domain < 1 or max_new_tokens < 1:
        raise CalibrationError("prompts_per_domain and max_new_tokens must be >= 1")
    if any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_TREE_NODES for n in tree_nodes):
        raise CalibrationError(f"tree_nodes must be integers in 1..{MAX_TREE_NODES}, got {list(tree_nodes)}")
    root = Path(artifact)
    gen = load(root, threads=threads, shared_pool=shared_pool)  # verifies every checksum before anything is written
    allowed = list(registry.calibrated(gen.manifest.draft_kind))
    proposers = list(proposers) if proposers else allowed
    if gen.tree is not None:  # asked for by name: tree drafters that calibrate no gamma of their own
        allowed += [p for p in TREE_DRAFTERS if p not in allowed and registry.get(p).runs_with(gen.manifest.draft_kind)]
    for p in proposers:
        if p not in allowed:
            raise InvalidArgument(f"proposer {p!r} is not available in this artifact (available: {', '.join(allowed)})")
    device = device_name or default_device_name()
    if not re.fullmatch(r"[A-Za-z0-9_.:-]+", device):
        raise CalibrationError(f"device name {device!r} must use letters, digits and _ . : - only")

    by_domain = _prompts_by_domain(domains, prompts, prompts_per_domain)
    measure_g = max(gammas)
    cases = {d: make_cases(gen.codec, plist, per_prompt_limit=True) for d, plist in by_domain.items()}
    greedy = gen.configure(
        gamma=measure_g, tree_nodes=0, temperature=0.0, top_p=1.0, top_k=0, seed=None, cache_prompt=False
    )
    # warm-up on a prompt outside the calibrated set (first-call allocations, ORT arena growth)
    run_one(gen, warmup_case(gen.codec), greedy.replace(proposer=proposers[0], max_new_tokens=WARMUP_TOKENS))
    trees = calibrate_trees.tree_proposers(gen, proposers) if tree_nodes else []
    sizes = sorted(set(tree_nodes))
    runs = sum(len(v) for v in cases.values())
    total = runs * (len(proposers) + len(trees) * len(sizes))
    rounds, in_loop = _observe(gen, cases, proposers, greedy, max_new_tokens, _shifted(progress, 0, total))

    timing_ids = next(iter(cases.values()))[0].ids
    if _costs_complete(costs, proposers) and (not trees or (costs or {}).get("tree_verify_s")):
        cost_table = _merge_costs(None, costs)
    else:
        measured = measure_costs(gen, timing_ids, measure_g + 1)
        for prop, (seconds, tokens) in in_loop.items():  # lookup: seconds per drafted token; eagle: head calls
            measured["draft_step_s"][prop] = seconds / tokens if tokens else 0.0  # (catch-up included) per token
        if trees:
            measured["tree_verify_s"] = calibrate_trees.measure_tree_costs(gen, timing_ids, max(sizes), TIMING_REPEATS)
        cost_table = _merge_costs(measured, costs)
    if not trees:  # no tree calibrated: no tree costs recorded (given ones included)
        cost_table["tree_verify_s"], cost_table["tree_draft_step_s"] = {}, {}
    choices = _choices(rounds, {d: len(v) for d, v in by_domain.items()}, gammas, cost_table)
    if trees:
        depth = {(d, p): choices[d][p]["gamma"] or measure_g for d in cases for p in trees}
        tell = _shifted(progress, runs * len(proposers), total)
        tree_runs = calibrate_trees.observe_trees(gen, cases, trees, greedy, depth, sizes, max_new_tokens, tell)
        if cost_table.get("method") != "given":  # measured: the tree runs' own draft seconds per node
            for prop in trees:
                node = [r for per in tree_runs.values() for r in per[prop].values()]
                drafted = sum(r.drafted for r in node)
                step = sum(r.draft_seconds for r in node) / drafted if drafted else 0.0
                cost_table["tree_draft_step_s"].setdefault(prop, step)
        calibrate_trees.choose_trees(choices, rounds, tree_runs, depth, cost_table, measure_g)

    meta = harness.run_metadata()
    profile = {
        "measured_at": meta["date"],
        "device": {**meta["machine"], "machine": platform.machine(), "threads": threads},
        "settings": {
            "gammas": gammas,
            "measure_gamma": measure_g,
            "prompts_per_domain": prompts_per_domain,
            "max_new_tokens": max_new_tokens,
            "proposers": proposers,
            "sampling": "greedy",
            "tree_nodes": sizes if trees else [],
            "tree_proposers": trees,
        },
        "costs": _costs_record(cost_table),
        "domains": choices,
    }
    doc = _read_existing(root)
    doc["profiles"][device] = profile
    if set_default or not doc.get("default_profile") or doc["default_profile"] not in doc["profiles"]:
        doc["default_profile"] = device
    if write:
        write_calibration(root, doc)
    return doc


def _shifted(progress: Progress | None, start: int, total: int) -> Progress | None:
    """`progress` told of runs `start` + n out of `total` (the chain and tree runs as one bar)."""
    if progress is None:
        return None
    return lambda n, _, label: progress(start + n, total, label)


def _prompts_by_domain(
    domains: Sequence[str], prompts: Sequence[Prompt] | None, per_domain: int
) -> dict[str, list[Prompt]]:
    """The first `per_domain` prompts of each domain, from `prompts` or else from the shipped sets
    (harness.load_prompt_set); domains without a prompt are left out."""
    if prompts is None:
        prompts = load_prompt_set(list(domains), limit=per_domain) if domains else []
    by_domain = {d: [p for p in prompts if p.domain == d][:per_domain] for d in domains}
    by_domain = {d: sel for d, sel in by_domain.items() if sel}
    if not by_domain:
        raise CalibrationError(f"no prompts for domains {list(domains)}")
    return by_domain


def _observe(
    gen, cases: dict[str, list[Case]], proposers: list[str], greedy, max_new_tokens: int, progress: Progress | None
) -> tuple[dict[str, dict[str, list[tuple[int, int]]]], dict[str, list]]:
    """Generate every case with every proposer at the measuring gamma. -> (domain -> proposer ->
    rounds (k, n), a plain step counting as (0, 0); proposer -> [draft seconds, drafted tokens] for
    the proposers whose draft step is timed in the loop)."""
    rounds: dict[str, dict[str, list[tuple[int, int]]]] = {}
    # LOOP, and the tree drafters calibrated for their trees (no draft step of their own to time)
    in_loop = {name: [0.0, 0] for name in proposers if registry.get(name).calibrate in (registry.LOOP, None)}
    total, done = sum(len(v) for v in cases.values()) * len(proposers), 0
    for d, dcases in cases.items():
        for prop in proposers:
            for case in dcases:
                config = greedy.replace(proposer=prop, max_new_tokens=min(case.max_new_tokens, max_new_tokens))
                rec = run_one(gen, case, config)
                rounds.setdefault(d, {}).setdefault(prop, []).extend(rec.round_sizes + [(0, 0)] * rec.plain_steps)
                if prop in in_loop:
                    in_loop[prop][0] += rec.draft_seconds
                    in_loop[prop][1] += rec.drafted
                done += 1
                if progress is not None:
                    progress(done, total, f"{d} {prop} {case.id}")
    return rounds, in_loop


def _choices(
    rounds: dict[str, dict[str, list[tuple[int, int]]]], prompts: dict[str, int], gammas: list[int], cost_table: dict
) -> dict[str, dict]:
    """domain -> proposer -> choose_gamma's entry and its prompt count; "default" pools every domain."""
    out = {
        d: {prop: {**choose_gamma(r, gammas, cost_table, prop), "prompts": prompts[d]} for prop, r in per_prop.items()}
        for d, per_prop in rounds.items()
    }
    pooled: dict[str, list[tuple[int, int]]] = {}
    for per_prop in rounds.values():
        for prop, r in per_prop.items():
            pooled.setdefault(prop, []).extend(r)
    out["default"] = {
        prop: {**choose_gamma(r, gammas, cost_table, prop), "prompts": sum(prompts.values())}
        for prop, r in pooled.items()
    }
    return out


def _costs_record(cost_table: dict) -> dict:
    """The costs as calibration.json stores them: seconds, and ratios to the decode step."""
    decode = cost_table["decode_s"]
    return {
        "decode_s": decode,
        "verify_s": {str(s): v for s, v in sorted(cost_table["verify_s"].items())},
        "draft_step_s": dict(cost_table["draft_step_s"]),
        "ratios": {
            "c": {p: s / decode for p, s in cost_table["draft_step_s"].items()} if decode else {},
            "v": {str(s): v / decode for s, v in sorted(cost_table["verify_s"].items())} if decode else {},
        },
        "method": cost_table.get("method", ""),
        **_tree_costs_record(cost_table, decode),
    }


def _tree_costs_record(cost_table: dict, decode: float) -> dict:
    """The tree graph's call costs (rows -> seconds, and ratios to the decode step) and the tree
    runs' draft seconds per node; nothing when no trees were calibrated."""
    tree = cost_table.get("tree_verify_s") or {}
    if not tree:
        return {}
    return {
        "tree_verify_s": {str(r): v for r, v in sorted(tree.items())},
        "tree_draft_step_s": dict(cost_table.get("tree_draft_step_s") or {}),
        "tree_ratios": {"v": {str(r): v / decode for r, v in sorted(tree.items())} if decode else {}},
    }


def _read_existing(root: Path) -> dict:
    """The current calibration.json if it has this format, else a fresh document (a file of
    another shape or version is replaced, its content being of no use to this runtime)."""
    path = root / CALIBRATION_NAME
    fresh = {"version": CALIBRATION_VERSION, "profiles": {}, "default_profile": None}
    if not path.is_file():
        return fresh
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return fresh
    if (
        not isinstance(doc, dict)
        or doc.get("version") != CALIBRATION_VERSION
        or not isinstance(doc.get("profiles"), dict)
    ):
        return fresh
    return doc


def write_calibration(root: str | Path, doc: dict) -> None:
    """Write calibration.json atomically and record its sha256 in manifest.json (also
    written atomically). The other checksums are kept as they are rather than recomputed
    from the folder, so a file changed since the last verification is never blessed; the
    result equals write_manifest's whenever the folder verifies."""
    root = Path(root)
    manifest = read_manifest(root)
    atomic_write_text(root / CALIBRATION_NAME, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    data = json.loads(manifest.to_json())
    data["files"] = {**manifest.files, CALIBRATION_NAME: sha256_file(root / CALIBRATION_NAME)}
    data["files"] = dict(sorted(data["files"].items()))
    atomic_write_text(root / MANIFEST_NAME, json.dumps(data, indent=2, sort_keys=True) + "\n")


def profile_gamma(doc: dict, domain: str | None, proposer: str, profile: str | None = None) -> int | None:
    """The calibrated gamma for (domain, proposer) in `profile` (default: default_profile),
    falling back to the 'default' domain; None when absent. The lookup the runtime needs."""
    entry = calibration_entry(doc, domain, proposer, profile)
    return None if entry is None else int(entry["gamma"])
