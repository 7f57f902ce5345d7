"""What speculation costs on a hybrid target with recurrent state (LFM2's gated short convolutions
between GQA layers), against an attention-only model of the same size: the mechanics, which do
not depend on the weights (random-init models; nothing is fetched).

    python benchmarks/hybrid_mechanics.py [--shape lfm2-1.2b] [--precisions fp32,int4] [--forms fused]
        [--past 600] [--gammas 4,8] [--tokens 64] [--repeats 7] [--threads 2] [--json OUT]

Models: per precision and graph form, a random-init LFM2 of --shape (lfm2-1.2b: transformers'
config of LiquidAI/LFM2-1.2B, specexport.plan.sizes) and beside it a Llama of the same hidden
size, layers, heads, KV heads, MLP width and vocabulary (every layer attention). fp32 graphs, and
int4 targets (MatMulNBits, round-to-nearest, the quantized-target path of the fused form). Each
graph gets the padding a bitwise target is built with (build/graphs.py BITWISE_FUSED): fp32 fused
padded attention; int4 padded calls (every call at least 2 rows: MatMulNBits' 1-row path gives
other low bits than its multi-row one, so the "1-row call" of an int4 target is its padded 2-row
call, the one target-only decoding pays); portable none.

Figures (each a median over --repeats, warm-up calls and runs outside the measured set):
  verify cost   one call of 1 + gamma rows against a 1-row call with --past positions in the
                cache (each call rolled back after timing); the models of a precision and form
                interleaved call by call, in rotated order. The host share is the part of the
                call spent outside ONNX Runtime's run (binding, state bookkeeping).
  rollback      the hybrid's state bookkeeping (recurrent.StateHistory: bind, store, and the
                rollback in truncate) timed call by call inside the ceiling runs below, as a share
                of their decode time; and a round (a call of 1 + gamma rows, then a rollback to
                half the draft accepted) with the bookkeeping against the same round without it
                (the states bound in place, nothing kept: no rollback possible), interleaved.
  ceiling       the real SpeculativeLoop, greedy, --tokens new tokens after a --prompt-tokens
                prompt: target-only decoding; a replay proposer drafting the recorded greedy answer
                (acceptance 1.0) at a fixed gamma of --ceiling-gamma; an always-wrong proposer
                (its first token is never the target's) under the adaptive draft-length policy
                (adaptive.GammaController, kept across runs as the generator keeps it), measured
                once the policy has switched speculation off (the warm-up run lets it react).
                Decode tok/s exclude the prefill; ratios are per repeat (adjacent runs), then the
                median.
  limits        what bounds each figure: the call-cost ceiling of the replay ((1 + gamma) x a
                1-row call / a (1 + gamma)-row call), the share of decode time outside ONNX Runtime
                (the loop's Python: argmax, verify, proposer, bookkeeping), the always-wrong
                policy's probe rounds.

Memory: a 1.2B-parameter fp32 graph is ~4.7 GB on disk and ~6 GB resident; --apart fp32 measures
the two models of a precision one after the other (not interleaved) so only one is on disk and in
memory at a time. Graphs go to a temporary folder deleted as soon as they are measured, or are
kept (and reused) in --work.
"""

from __future__ import annotations

import gc
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "runtime"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from specexport.bench import harness  # noqa: E402
from specexport.errors import HarnessError  # noqa: E402
from specexport_runtime import contract  # noqa: E402
from specexport_runtime.adaptive import GammaController  # noqa: E402
from specexport_runtime.config import GeneratorConfig  # noqa: E402
from specexport_runtime.engine import OrtModel, SessionConfig  # noqa: E402
from specexport_runtime.generator import GenerationStats, LoopSetup, SpeculativeLoop  # noqa: E402
from specexport_runtime.policy import RoundDraft  # noqa: E402
from specexport_runtime.proposers import Proposal, Proposer  # noqa: E402

_TINY_LAYERS = ["conv", "conv", "full_attention", "conv", "conv", "full_attention"]
SHAPES = {
    "lfm2-1.2b": None,  # specexport.plan.sizes.KNOWN_CONFIGS["LiquidAI/LFM2-1.2B"]
    # tests/tiny.py's lfm2 (spread-out init: no near-ties in greedy argmax)
    "tiny": dict(
        model_type="lfm2",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=_TINY_LAYERS,
        conv_L_cache=3,
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True,
        norm_eps=1e-5,
        initializer_range=0.2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    # an assumed Qwen3.5-0.8B shape (not read from the real config.json, which cannot be fetched here):
    # Gated DeltaNet layers with one gated full-attention layer in four
    "qwen3.5-0.8b": dict(
        model_type="qwen3_5_text",
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        layer_types=["linear_attention"] * 3 + ["full_attention"],  # repeated to num_hidden_layers
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
}
# shapes that are not a real checkpoint's config: said in --help and in the output
ASSUMED = {"qwen3.5-0.8b": "an assumed Qwen3.5-0.8B shape, not read from the real config.json"}
PRECISIONS = ("fp32", "int4")
FORMS = {"fused": contract.HEAD_MAJOR_INPLACE, "portable": contract.TIME_MAJOR}
KINDS = ("hybrid", "attention")
METHODS = ("target-only", "replay", "always-wrong")


# --------------------------------------------------------------------------- models and graphs


def shape_config(name: str, overrides: list[str]) -> dict:
    if name not in SHAPES:
        raise HarnessError(f"--shape must be one of {sorted(SHAPES)}, got {name!r}")
    if SHAPES[name] is None:
        from specexport.plan.sizes import KNOWN_CONFIGS

        values = dict(KNOWN_CONFIGS["LiquidAI/LFM2-1.2B"])
    else:
        values = dict(SHAPES[name])
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or key not in values:
            raise HarnessError(f"--override takes KEY=INT for a key of the shape's config, got {item!r}")
        values[key] = int(text)
    layers = values["num_hidden_layers"]
    if len(values["layer_types"]) != layers:  # the pattern repeated, its first ones
        pattern = values["layer_types"]
        values["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return values


def attention_layer(kind: str) -> bool:
    return kind in ("full_attention", "attention", "sliding_attention")


def describe(name: str, cfg: dict) -> str:
    """One line: the shape's size, its layers by type, and whether it is assumed."""
    recurrent = [t for t in cfg["layer_types"] if not attention_layer(t)]
    kinds = ", ".join(f"{recurrent.count(t)} {t}" for t in dict.fromkeys(recurrent))
    head = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    text = (
        f"shape {name} ({cfg['model_type']}): hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers"
        f" ({kinds}), heads {cfg['num_attention_heads']}/{cfg['num_key_value_heads']} x {head}, MLP {mlp_width(cfg)},"
        f" vocab {cfg['vocab_size']}"
    )
    return text + (f" [{ASSUMED[name]}]" if name in ASSUMED else "")


def mlp_width(cfg: dict) -> int:
    """LFM2's MLP width as transformers' Lfm2MLP computes it (2/3, multiplier, rounded up)."""
    ff = cfg["intermediate_size"]
    if cfg.get("block_auto_adjust_ff_dim"):
        ff = int(2 * ff / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            ff = int(cfg["block_ffn_dim_multiplier"] * ff)
        m = cfg["block_multiple_of"]
        ff = m * ((ff + m - 1) // m)
    return ff


def hf_config(kind: str, cfg: dict):
    """transformers config: the hybrid itself, or its attention-only twin (LFM2: a Llama; Qwen3.5: a
    Qwen3, whose attention has the same query/key norms, heads and head size, full rotary)."""
    from transformers import AutoConfig

    values = {k: v for k, v in cfg.items() if k != "model_type"}
    if kind == "hybrid":
        return AutoConfig.for_model(cfg["model_type"], **values)
    twin = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=mlp_width(cfg),
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        rms_norm_eps=cfg.get("norm_eps", cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        initializer_range=cfg.get("initializer_range", 0.02),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
    )
    if cfg["model_type"] == "qwen3_5_text":
        theta = cfg["rope_parameters"]["rope_theta"]
        rope = {"rope_type": "default", "rope_theta": theta}
        return AutoConfig.for_model("qwen3", head_dim=cfg["head_dim"], rope_parameters=rope, **twin)
    return AutoConfig.for_model("llama", **twin)


@dataclass
class Graph:
    kind: str
    precision: str
    form: str
    path: Path
    spec: object  # GraphSpec
    params: int
    bytes: int
    build_seconds: float
    min_rows: int = 1  # padded calls (feature row_padding)
    cache_pad: int = 0  # padded attention (fused)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.precision} {self.form}"


def padding(precision: str, form: str) -> tuple[int, int]:
    """(min_rows, cache_pad) of a graph: what a bitwise target of this precision and form is built
    with (build/graphs.py BITWISE_FUSED; the module docstring)."""
    if precision == "int4":
        return 2, 0
    return (1, 1) if FORMS[form] == contract.HEAD_MAJOR_INPLACE else (1, 0)


def build_graph(kind: str, precision: str, form: str, cfg: dict, max_context: int, args, root: Path) -> Graph:
    """The graph of one model (reused from --work when its settings match)."""
    out = root / f"{kind}-{precision}-{form}"
    min_rows, cache_pad = padding(precision, form)
    stamp = repr((cfg, max_context, args.block_size, args.accuracy_level, args.seed, min_rows, cache_pad))
    saved = out / "graph.pkl"
    if saved.exists():
        graph = pickle.loads(saved.read_bytes())
        if graph.get("stamp") == stamp:
            return Graph(**graph["graph"])
    import torch
    from transformers import AutoModelForCausalLM

    from specexport.graphs.decoder import build_decoder
    from specexport.graphs.quantized_target import QuantizedWeights

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    # fp16 in memory (half of fp32's); the writer converts one weight at a time to fp32
    model = AutoModelForCausalLM.from_config(hf_config(kind, cfg), dtype=torch.float16).eval()
    params = sum(p.numel() for p in model.parameters())
    weights = None
    if precision == "int4":
        weights = QuantizedWeights("int4", args.block_size, args.accuracy_level, "fp32", "fp32", {})
    result = build_decoder(
        model,
        out,
        max_context,
        kv_layout=FORMS[form],
        weights=weights,
        min_rows=min_rows,
        pad_attention=cache_pad > 0,
        dtype=torch.float32,
    )
    del model
    gc.collect()
    seconds = time.perf_counter() - start
    graph = Graph(kind, precision, form, result.path, result.spec, params, result.bytes, seconds, min_rows, cache_pad)
    saved.write_bytes(pickle.dumps({"stamp": stamp, "graph": graph.__dict__}))
    return graph


# --------------------------------------------------------------------------- state bookkeeping


class TimedStates:
    """A StateHistory whose calls from OrtModel are timed: bind (rows + bind), store, truncate
    (the kept-state check and forget_after of a rollback)."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds = {"bind": 0.0, "store": 0.0, "truncate": 0.0}
        self.calls = {"bind": 0, "store": 0, "truncate": 0}

    def _timed(self, key: str, fn, *a):
        start = time.perf_counter()
        out = fn(*a)
        self.seconds[key] += time.perf_counter() - start
        self.calls[key] += 1
        return out

    def rows(self, *a):
        return self._timed("bind", self.inner.rows, *a)

    def bind(self, *a):
        return self._timed("bind", self.inner.bind, *a)

    def store(self, *a):
        return self._timed("store", self.inner.store, *a)

    def state(self, *a):
        return self._timed("truncate", self.inner.state, *a)

    def forget_after(self, *a):
        return self._timed("truncate", self.inner.forget_after, *a)

    def total(self) -> float:
        return sum(self.seconds.values())

    def __getattr__(self, name):
        return getattr(self.inner, name)


class NoRollbackStates:
    """The same graph inputs and outputs bound (the zero state in, the call's states out), nothing
    kept: what a decoder that never rolls back pays. Its logits are not the model's (the state
    never advances); only its time is used."""

    def __init__(self, inner):
        self.inner = inner

    def rows(self, S, last_rows):
        return self.inner.rows(S, last_rows)

    def bind(self, io, P, rows):
        io.bind_cpu_input(contract.STATE_INDEX, rows)
        for j, (past, out) in enumerate(zip(self.inner.zeros, self.inner.out)):
            io.bind_input(contract.past_state(j), "cpu", 0, past.dtype, list(past.shape), past.ctypes.data)
            shape = [1, rows.size, *self.inner.shapes[j]]
            io.bind_output(contract.new_state(j), "cpu", 0, out.dtype, shape, out.ctypes.data)

    def store(self, P, rows):
        pass

    def state(self, length):
        return self.inner.zeros

    def forget_after(self, length):
        pass

    def reset(self):
        pass

    def __getattr__(self, name):
        return getattr(self.inner, name)


# --------------------------------------------------------------------------- proposers


class ReplayProposer(Proposer):
    """Drafts the recorded greedy answer: acceptance 1.0 while the output follows it."""

    name = "replay"

    def __init__(self, answer: list[int]):
        self.answer = answer

    def start(self, prompt):
        self.prompt_len = len(prompt)

    def propose(self, committed, gamma, params, rng) -> Proposal:
        pos = len(committed) - self.prompt_len
        return Proposal([int(t) for t in self.answer[pos : pos + gamma]], None)

    def commit(self, committed, n_new):
        pass


class WrongProposer(Proposer):
    """Drafts a first token that is never the target's (the recorded answer's token + 1)."""

    name = "always-wrong"

    def __init__(self, answer: list[int], vocab: int):
        self.answer, self.vocab = answer, vocab

    def start(self, prompt):
        self.prompt_len = len(prompt)

    def propose(self, committed, gamma, params, rng) -> Proposal:
        pos = len(committed) - self.prompt_len
        right = self.answer[pos] if pos < len(self.answer) else 0
        wrong = (right + 1) % self.vocab
        return Proposal([wrong] * gamma, None)

    def commit(self, committed, n_new):
        pass


# --------------------------------------------------------------------------- subjects


@dataclass
class Subject:
    graph: Graph
    model: OrtModel
    timed: TimedStates | None
    vocab: int
    controller: GammaController = field(default_factory=GammaController)
    answers: dict = field(default_factory=dict)  # prompt key -> recorded greedy answer
    react_rounds: int | None = None  # drafted rounds the policy took to switch speculation off

    @property
    def label(self) -> str:
        return self.graph.label


def load_subject(graph: Graph, max_context: int, args) -> Subject:
    config = SessionConfig(threads=args.threads, shared_pool=args.pool == "shared")
    model = OrtModel(
        graph.path,
        graph.spec,
        max_context,
        config,
        max_rows=args.max_rows,
        min_rows=graph.min_rows,
        cache_pad=graph.cache_pad,
    )
    timed = None
    if model.states is not None:
        timed = TimedStates(model.states)
        model.states = timed
    return Subject(graph, model, timed, graph.spec.embedding_rows)


def call_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(3, vocab, size=n).tolist()


def timed_call(model: OrtModel, ids: list[int]) -> tuple[float, float]:
    """(wall seconds of forward, seconds inside ONNX Runtime's run) of one call."""
    before = model.stats.seconds
    start = time.perf_counter()
    model.forward(ids, last_rows=len(ids))
    return time.perf_counter() - start, model.stats.seconds - before


def verify_cost(subjects: list[Subject], args) -> list[dict]:
    sizes = [1] + [1 + g for g in args.gammas]
    rng = np.random.default_rng(args.seed)
    prompt = call_ids(rng, min(s.vocab for s in subjects), args.past)
    calls = {s.label: call_ids(rng, s.vocab, max(sizes)) for s in subjects}
    for s in subjects:
        s.model.reset()
        s.model.forward(prompt)
        for size in sizes:  # warm-up: every size once, untimed
            s.model.forward(calls[s.label][:size], last_rows=size)
            s.model.truncate(args.past)
    wall = {(s.label, n): [] for s in subjects for n in sizes}
    run = {(s.label, n): [] for s in subjects for n in sizes}
    for r in range(args.repeats):
        for s in harness.rotated(subjects, r):
            for size in harness.rotated(sizes, r):
                w, t = timed_call(s.model, calls[s.label][:size])
                s.model.truncate(args.past)
                wall[s.label, size].append(w)
                run[s.label, size].append(t)
    rows = []
    for s in subjects:
        one = statistics.median(wall[s.label, 1])
        row = {"model": s.label, "kind": s.graph.kind, "precision": s.graph.precision, "form": s.graph.form}
        row["past"] = args.past
        row["calls"] = {}
        for size in sizes:
            w, t = statistics.median(wall[s.label, size]), statistics.median(run[s.label, size])
            row["calls"][str(size)] = {"ms": w * 1e3, "run_ms": t * 1e3, "vs_1_row": w / one, "host_share": 1 - t / w}
        rows.append(row)
    return rows


def timed_round(model: OrtModel, real: TimedStates, states, ids: list[int], keep: int, P: int):
    """Seconds of one round at cursor P with `states` bound (a call on ids, then the rollback to
    `keep`) and the bookkeeping timed in it (bind, store, truncate); then back to P, untimed."""
    model.states = states
    before = dict(real.seconds)
    start = time.perf_counter()
    model.forward(ids, last_rows=len(ids))
    model.truncate(keep)
    seconds = time.perf_counter() - start
    spent = {k: real.seconds[k] - before[k] for k in before}
    model.states = real
    model.truncate(P)  # the next round starts at P again (state P is kept)
    return seconds, spent


def rollback_rounds(subjects: list[Subject], args) -> list[dict]:
    """A round (1 + gamma rows at cursor P, then the rollback to half the draft accepted) with the
    state bookkeeping and without it, interleaved."""
    rows = []
    rng = np.random.default_rng(args.seed + 1)
    for s in subjects:
        if s.timed is None:
            continue
        model, real = s.model, s.timed
        without = NoRollbackStates(real.inner)
        model.reset()
        model.forward(call_ids(rng, s.vocab, args.past))
        P = args.past
        for gamma in args.gammas:
            ids = call_ids(rng, s.vocab, 1 + gamma)
            keep = P + 1 + gamma // 2

            timed_round(model, real, real, ids, keep, P), timed_round(model, real, without, ids, keep, P)  # warm-up
            times, spent = {"with": [], "without": []}, []
            for r in range(args.repeats):
                for name in harness.rotated(["with", "without"], r):
                    seconds, parts = timed_round(model, real, real if name == "with" else without, ids, keep, P)
                    times[name].append(seconds)
                    if name == "with":
                        spent.append(parts)
            w, wo = statistics.median(times["with"]), statistics.median(times["without"])
            per = {k: statistics.median(p[k] for p in spent) for k in real.seconds}
            share = statistics.median(sum(p.values()) / t for p, t in zip(spent, times["with"]))
            rows.append(
                {
                    "model": s.label,
                    "gamma": gamma,
                    "round_ms_with": w * 1e3,
                    "round_ms_without": wo * 1e3,
                    "overhead_ab": (w - wo) / w,
                    "bind_us": per["bind"] * 1e6,
                    "store_us": per["store"] * 1e6,
                    "truncate_us": per["truncate"] * 1e6,
                    "direct_share": share,
                }
            )
    return rows


def run_loop(s: Subject, method: str, prompt: list[int], tokens: int, args, until_off: bool = False) -> dict:
    """One generation through SpeculativeLoop; decode figures exclude the prefill. until_off: stop
    once the draft-length policy has switched speculation off (the always-wrong warm-up)."""
    answer = s.answers.get(tuple(prompt), [])
    if method == "target-only":
        config = GeneratorConfig(max_new_tokens=tokens, speculative=False)
        proposer = WrongProposer(answer, s.vocab)  # never asked
    elif method == "replay":
        config = GeneratorConfig(max_new_tokens=tokens, gamma=args.ceiling_gamma)
        proposer = ReplayProposer(answer)
    else:
        config = GeneratorConfig(max_new_tokens=tokens)
        proposer = WrongProposer(answer, s.vocab)
    ctl = s.controller if method == "always-wrong" else None
    policy = RoundDraft.of(config, ctl)
    stats = GenerationStats()
    loop = SpeculativeLoop(LoopSetup(s.model, proposer, config, np.random.default_rng(0), policy=policy, stats=stats))
    policy.start()
    out: list[int] = []
    t_first = run_before = keep_before = None
    switched_off = None
    for new in loop.rounds(prompt, s.model.max_context):
        out += new
        if t_first is None:
            t_first = time.perf_counter()
            run_before = s.model.stats.seconds
            keep_before = s.timed.total() if s.timed is not None else 0.0
        if ctl is not None and switched_off is None and not ctl.speculating:
            switched_off = stats.rounds
        if len(out) >= tokens + 1 or (until_off and switched_off is not None):
            break
    seconds = time.perf_counter() - t_first
    run = s.model.stats.seconds - run_before
    keep = (s.timed.total() if s.timed is not None else 0.0) - keep_before
    return {
        "tokens": out,
        "decode_tokens": len(out) - 1,
        "seconds": seconds,
        "tok_s": (len(out) - 1) / seconds,
        "run_share": run / seconds,
        "bookkeeping_share": keep / seconds,
        "rounds": stats.rounds,
        "plain_steps": stats.plain_steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "switched_off": switched_off,
        "draft_per_round": stats.drafted / stats.rounds if stats.rounds else 0.0,
    }


def controller_state(ctl: GammaController) -> dict:
    """What the adaptive policy believes after the measured runs: on or off, its acceptance, and
    its cost model (ms of each call size it timed, and of the fitted line)."""
    line = {str(r): ctl.cost.seconds(r) * 1e3 for r in (1, 3, 9)} if ctl.cost.timed(1) else {}
    return {
        "speculating": ctl.speculating,
        "alpha": ctl.alpha,
        "gamma": ctl.gamma,
        "timed_ms": {str(r): v * 1e3 for r, v in sorted(ctl.cost.by_rows.items())},
        "line_ms": line,
    }


def ceiling(subjects: list[Subject], args) -> list[dict]:
    rng = np.random.default_rng(args.seed + 2)
    vocab = min(s.vocab for s in subjects)
    warm, prompt = call_ids(rng, vocab, args.prompt_tokens), call_ids(rng, vocab, args.prompt_tokens)
    longest = args.tokens + args.ceiling_gamma + 2
    for s in subjects:
        # recorded greedy answers (untimed), then one warm-up run of every method on the warm-up
        # prompt; the always-wrong warm-up runs until the policy has switched speculation off
        for p in (warm, prompt):
            s.answers[tuple(p)] = run_loop(s, "target-only", p, longest, args)["tokens"]
        run_loop(s, "replay", warm, args.tokens, args)
        room = min(args.warmup_tokens, s.model.max_context - len(warm) - 2)
        react = run_loop(s, "always-wrong", warm, room, args, until_off=True)
        s.react_rounds = react["switched_off"]
    samples = {(s.label, m): [] for s in subjects for m in METHODS}
    for r in range(args.repeats):
        for s in harness.rotated(subjects, r):
            for m in harness.rotated(list(METHODS), r):
                samples[s.label, m].append(run_loop(s, m, prompt, args.tokens, args))
    rows = []
    for s in subjects:
        answer = s.answers[tuple(prompt)]
        row = {"model": s.label, "kind": s.graph.kind, "precision": s.graph.precision, "form": s.graph.form}
        row["tokens"] = args.tokens
        row["gamma"] = args.ceiling_gamma
        for m in METHODS:
            runs = samples[s.label, m]
            row[m] = {
                "tok_s": statistics.median(x["tok_s"] for x in runs),
                "run_share": statistics.median(x["run_share"] for x in runs),
                "bookkeeping_share": statistics.median(x["bookkeeping_share"] for x in runs),
                "rounds": statistics.median(x["rounds"] for x in runs),
                "plain_steps": statistics.median(x["plain_steps"] for x in runs),
                "drafted": sum(x["drafted"] for x in runs),
                "accepted": sum(x["accepted"] for x in runs),
                "draft_per_round": statistics.median(x["draft_per_round"] for x in runs),
                "equal_to_target_only": all(x["tokens"][: args.tokens + 1] == answer[: args.tokens + 1] for x in runs),
            }
        base = samples[s.label, "target-only"]
        for m in ("replay", "always-wrong"):
            ratios = [x["tok_s"] / b["tok_s"] for x, b in zip(samples[s.label, m], base)]
            row[m]["vs_target_only"] = statistics.median(ratios)
        rep = row["replay"]
        rep["acceptance"] = rep["accepted"] / rep["drafted"] if rep["drafted"] else 0.0
        row["always-wrong"]["policy_reacted_after_rounds"] = s.react_rounds
        row["always-wrong"]["controller_after"] = controller_state(s.controller)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- report


def limits(verify: list[dict], rollback: list[dict], ceil: list[dict], gamma: int) -> list[str]:
    lines = []
    cost = {r["model"]: r["calls"] for r in verify}
    for row in ceil:
        name, rep, wrong, base = row["model"], row["replay"], row["always-wrong"], row["target-only"]
        calls = cost.get(name, {})
        one, full = calls.get("1"), calls.get(str(gamma + 1))
        if one and full and rep["acceptance"] > 0:
            bound = (gamma + 1) * one["run_ms"] / full["run_ms"]
            lines.append(
                f"{name}: replay {rep['vs_target_only']:.2f}x against a call-cost bound of {bound:.2f}x"
                f" ((1 + {gamma}) x {one['run_ms']:.1f} ms / {full['run_ms']:.1f} ms); ONNX Runtime's runs are"
                f" {rep['run_share']:.0%} of its decode time (target-only {base['run_share']:.0%}), the state"
                f" bookkeeping {rep['bookkeeping_share']:.1%}"
            )
        probe = wrong["rounds"] / max(1, wrong["rounds"] + wrong["plain_steps"])
        ctl = wrong["controller_after"]
        lines.append(
            f"{name}: always-wrong {wrong['vs_target_only']:.3f}x: {probe:.1%} of its target calls drafted"
            f" (policy off after {wrong['policy_reacted_after_rounds']} drafted rounds in the warm-up; in the"
            f" runs {wrong['draft_per_round']:.1f} tokens drafted a round; afterwards it is"
            f" {'on' if ctl['speculating'] else 'off'}, alpha {ctl['alpha']:.3f}, timed ms by rows"
            f" {fmt_costs(ctl['timed_ms'])}); ONNX Runtime's runs {wrong['run_share']:.0%} of its decode time"
        )
    for r in verify:
        worst = max(c["host_share"] for c in r["calls"].values())
        lines.append(f"{r['model']}: verify calls are {1 - worst:.0%}+ inside ONNX Runtime (host share <= {worst:.1%})")
    return lines


def fmt_costs(costs: dict) -> str:
    return ", ".join(f"{r}: {v:.0f}" for r, v in costs.items()) or "none"


def fmt(x: float, spec: str = ".2f") -> str:
    return format(x, spec)


def report(doc: dict) -> str:
    out = [f"\n{doc['shape_line']}"] if doc.get("shape_line") else []
    gammas = doc["settings"]["gammas"]
    out.append(f"\n### Verify cost (past {doc['settings']['past']}, median ms per call; x = against the 1-row call)\n")
    head = "| model | 1 row ms |" + "".join(f" {1 + g} rows ms | x |" for g in gammas) + " host share |"
    out += [head, "|" + "---|" * (3 + 2 * len(gammas))]
    for r in doc["verify"]:
        c = r["calls"]
        cells = "".join(f" {fmt(c[str(1 + g)]['ms'])} | {fmt(c[str(1 + g)]['vs_1_row'])}x |" for g in gammas)
        host = max(v["host_share"] for v in c.values())
        out.append(f"| {r['model']} | {fmt(c['1']['ms'])} |{cells} {host:.1%} |")
    out.append("\n### Rollback overhead (hybrid; a round = 1 + gamma rows, then rollback to half the draft)\n")
    out += [
        "| model | gamma | round ms | without bookkeeping ms | A/B overhead | bind us | store us | truncate us"
        " | direct share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rollback"]:
        out.append(
            f"| {r['model']} | {r['gamma']} | {fmt(r['round_ms_with'])} | {fmt(r['round_ms_without'])} |"
            f" {r['overhead_ab']:+.1%} | {fmt(r['bind_us'], '.0f')} | {fmt(r['store_us'], '.0f')} |"
            f" {fmt(r['truncate_us'], '.0f')} | {r['direct_share']:.2%} |"
        )
    s = doc["settings"]
    out.append(
        f"\n### Ceiling (SpeculativeLoop, greedy, {s['tokens']} tokens after {s['prompt_tokens']} prompt tokens,"
        f" decode tok/s)\n"
    )
    out += [
        f"| model | target-only | replay g{s['ceiling_gamma']} | x | acceptance | bookkeeping share |"
        " always-wrong | x | drafted rounds | outputs equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["ceiling"]:
        t, rep, w = r["target-only"], r["replay"], r["always-wrong"]
        equal = all(r[m]["equal_to_target_only"] for m in METHODS)
        probes = f"{w['rounds']:.0f}/{w['rounds'] + w['plain_steps']:.0f}"
        out.append(
            f"| {r['model']} | {fmt(t['tok_s'], '.1f')} | {fmt(rep['tok_s'], '.1f')} | {rep['vs_target_only']:.2f}x |"
            f" {rep['acceptance']:.2f} | {rep['bookkeeping_share']:.2%} | {fmt(w['tok_s'], '.1f')} |"
            f" {w['vs_target_only']:.3f}x | {probes} | {'yes' if equal else 'NO'} |"
        )
    out.append("\n### What limits each figure\n")
    out += [f"- {line}" for line in doc["limits"]]
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument(
        "--shape",
        default="lfm2-1.2b",
        help=f"model shape: {', '.join(SHAPES)} (default lfm2-1.2b: transformers' config of LiquidAI/LFM2-1.2B;"
        " qwen3.5-0.8b: an assumed Qwen3.5-0.8B shape, not read from the real config.json: vocab 248320, hidden"
        " 1024, 24 layers of 3 Gated DeltaNet then 1 gated full attention, heads 8/2 x 256, partial rotary 0.25,"
        " DeltaNet heads 16/16 x 128, MLP 3584, tied embeddings; its attention-only twin is a Qwen3 of the same"
        " hidden, layers, heads, MLP width and vocabulary)",
    )
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="change one integer of the shape's config (e.g. num_hidden_layers=8: the layer pattern's first"
        " ones), repeatable; the attention-only twin follows",
    )
    ap.add_argument("--precisions", default="fp32,int4", help="comma list of fp32, int4 (default fp32,int4)")
    ap.add_argument(
        "--forms",
        default="fused",
        help="comma list of graph forms: fused (head_major_inplace), portable (time_major; fp32 only) (default fused)",
    )
    ap.add_argument(
        "--apart",
        default="",
        help="comma list of precisions whose hybrid and attention-only models are measured one after the other"
        " instead of interleaved (one model on disk and in memory at a time; default none)",
    )
    ap.add_argument("--kinds", default="hybrid,attention", help="comma list of hybrid, attention (default both)")
    ap.add_argument("--past", type=int, default=600, help="cache positions before a timed verify call (default 600)")
    ap.add_argument("--gammas", default="4,8", help="draft lengths whose 1 + gamma-row calls are timed (default 4,8)")
    ap.add_argument("--ceiling-gamma", type=int, default=8, help="the replay proposer's fixed gamma (default 8)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per ceiling generation (default 64)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length of the ceiling runs (default 32)")
    ap.add_argument(
        "--warmup-tokens",
        type=int,
        default=400,
        help="most tokens of the always-wrong warm-up run that lets the policy react (default 400)",
    )
    ap.add_argument("--repeats", type=int, default=7, help="measurements per figure; medians are reported (default 7)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument(
        "--pool",
        choices=("shared", "own"),
        default="shared",
        help="shared: the models run on ONNX Runtime's process-wide thread pool, as the CLIs do (no idle pool"
        " spins while the other model runs); own: a pool per session (default shared)",
    )
    ap.add_argument("--max-rows", type=int, default=64, help="rows of one call the runtime's buffers hold (default 64)")
    ap.add_argument("--block-size", type=int, default=32, help="int4 block size (default 32)")
    ap.add_argument("--accuracy-level", type=int, default=4, help="int4 MatMulNBits accuracy_level (default 4)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and token ids (default 0)")
    ap.add_argument(
        "--work", default=None, metavar="DIR", help="keep the graphs here and reuse them (default: a temporary folder)"
    )
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command, settings and figures here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.gammas = harness.int_list(args.gammas, "--gammas")
    precisions = [p for p in args.precisions.split(",") if p]
    forms = [f for f in args.forms.split(",") if f]
    apart = {p for p in args.apart.split(",") if p}
    kinds = [k for k in args.kinds.split(",") if k]
    if any(k not in KINDS for k in kinds) or not kinds:
        raise HarnessError(f"--kinds takes a comma list of {', '.join(KINDS)}, got {args.kinds!r}")
    if any(p not in PRECISIONS for p in precisions) or not precisions:
        raise HarnessError(f"--precisions takes a comma list of {', '.join(PRECISIONS)}, got {args.precisions!r}")
    if any(f not in FORMS for f in forms) or not forms:
        raise HarnessError(f"--forms takes a comma list of {', '.join(FORMS)}, got {args.forms!r}")
    for name in ("repeats", "threads", "tokens", "prompt_tokens", "past", "ceiling_gamma"):
        if getattr(args, name) < 1:
            raise HarnessError(f"--{name.replace('_', '-')} must be at least 1")
    if max(args.gammas + [args.ceiling_gamma]) + 1 >= args.max_rows:
        raise HarnessError("--max-rows must exceed every 1 + gamma")
    cfg = shape_config(args.shape, args.override)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    meta["threads"] = args.threads
    max_context = max(
        args.past + max(args.gammas) + 8, args.prompt_tokens + args.warmup_tokens + args.ceiling_gamma + 8
    )
    print(harness.header(meta))
    doc_shape = describe(args.shape, cfg)
    print(f"threads: {args.threads} (pool {args.pool}); {doc_shape}; max_context {max_context}", flush=True)
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="hybrid-mechanics-"))
    root.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "settings": {**vars(args)}, "shape": cfg, "models": [], "verify": [], "rollback": []}
    doc["shape_line"], doc["shape_note"] = doc_shape, ASSUMED.get(args.shape, "")
    doc["ceiling"] = []
    try:
        for precision in precisions:
            for form in forms:
                if precision == "int4" and form != "fused":
                    print(f"skipped: int4 {form} (quantized targets are written in the fused form)", flush=True)
                    continue
                groups = [[k] for k in kinds] if precision in apart else [kinds]
                for kinds in groups:
                    measure_group(kinds, precision, form, cfg, max_context, args, root, doc)
    finally:
        if not args.work:
            shutil.rmtree(root, ignore_errors=True)
    doc["limits"] = limits(doc["verify"], doc["rollback"], doc["ceiling"], args.ceiling_gamma)
    print(report(doc))
    if args.json:
        harness.write_json(args.json, doc)
    return 0


def measure_group(kinds, precision, form, cfg, max_context, args, root: Path, doc: dict) -> None:
    graphs = []
    for kind in kinds:
        print(f"building {kind} {precision} {form} ...", flush=True)
        graph = build_graph(kind, precision, form, cfg, max_context, args, root)
        print(
            f"  {graph.params / 1e6:.0f} M parameters, {graph.bytes / 2**30:.2f} GiB, {graph.build_seconds:.0f} s",
            flush=True,
        )
        graphs.append(graph)
        doc["models"].append(
            {"model": graph.label, "parameters": graph.params, "bytes": graph.bytes, "build_s": graph.build_seconds}
        )
    subjects = [load_subject(g, max_context, args) for g in graphs]
    label = " and ".join(s.label for s in subjects)
    print(f"verify cost: {label}", flush=True)
    doc["verify"] += verify_cost(subjects, args)
    print(f"rollback rounds: {label}", flush=True)
    doc["rollback"] += rollback_rounds(subjects, args)
    print(f"ceiling: {label}", flush=True)
    doc["ceiling"] += ceiling(subjects, args)
    del subjects
    gc.collect()
    if not args.work:
        for g in graphs:
            shutil.rmtree(g.path.parent, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
