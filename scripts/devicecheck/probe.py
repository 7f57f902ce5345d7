"""The performance probe: a random-init model of Llama-3.2-1B's shape, fp16, fused graph, on the device.

No model file travels: the weights are random (drawn on the GPU when torch sees one) and the
graph is written by specexport.graphs.decoder.build_decoder. What it measures:

    per_call      one forward at past 512: decode S=1 and verify S=2, 4, 8, 16 (median ms), and
                  whether row 0 of an S-row call equals the S=1 call's row (row invariance)
    target_only   greedy decode tokens/s through the runtime's loop (prefill excluded)
    self_draft    the speculative loop with the same graph as its own draft: every token is
                  accepted when the kernels are row-invariant, and it can never be faster than
                  target-only (k draft decodes + one verify per k+1 tokens), so a speedup above
                  MAX_SPEEDUP means the measurement is wrong; the time per round outside ONNX
                  Runtime is the loop's own overhead
    cuda_graph    a session with the CUDA EP's enable_cuda_graph on the same fixed in-place
                  buffers: decode steps replayed from a captured graph vs the plain session's
                  logits; whether it worked, its cost, or the error text
    bandwidth     weight bytes read per token / the GPU's memory bandwidth (null when the GPU
                  is not in BANDWIDTH): the fastest decode the memory allows

With the CPU standing in (DEVICE_CHECK_PROVIDER=cpu) the same code runs on a tiny shape and is
labelled simulated: a 1B fp16 model on a small CPU would take far too long.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from devicecheck.cudagraph import cuda_graph, graph_log_lines, native_stderr  # noqa: F401  (tests reach them here)

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    max_position_embeddings=2048,
)  # Llama-3.2-1B's shape (its llama3 rope scaling changes no cost)
TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
SHAPES = {"llama-3.2-1b": LLAMA_1B, "tiny": TINY}
PAST = 512
SEQS = (1, 2, 4, 8, 16)
NEW_TOKENS = 128
GAMMA = 4
MAX_CONTEXT = 1024
MAX_SPEEDUP = 1.10  # the self-draft can't be faster; above this the timing is wrong
# GPU name (nvidia-smi) substring -> bytes/s, most specific first (vendor datasheets)
BANDWIDTH = (
    ("H200", 4.8e12, "H200 datasheet: 4.8 TB/s HBM3e"),
    ("H100 PCIe", 2.0e12, "H100 PCIe datasheet: 2.0 TB/s"),
    ("H100 NVL", 3.9e12, "H100 NVL datasheet: 3.9 TB/s"),
    ("H100", 3.35e12, "H100 SXM datasheet: 3.35 TB/s"),
    ("A100-SXM4-80GB", 2.039e12, "A100 80GB SXM datasheet: 2.039 TB/s"),
)
# seconds each part needs on an H200-class host (build: 16 CPU cores writing 2.5 GB)
NEEDS_1B = {"build": 120, "session": 30, "per_call": 15, "target_only": 10, "run": 15}
NEEDS_TINY = {"build": 10, "session": 3, "per_call": 5, "target_only": 5, "run": 5}


def bandwidth_for(gpu_name: str | None) -> tuple[float | None, str | None]:
    for key, value, source in BANDWIDTH:
        if gpu_name and key in gpu_name:
            return value, source
    return None, None


def make_model(shape: dict, seed: int = 0):
    """A random fp16 Llama of `shape`: allocated without init (meta, then empty), ties restored,
    rotary tables computed, norms 1, weights N(0, 1/hidden) drawn on the GPU when there is one
    (activations stay O(1) in fp16, and the layers outweigh the tied embedding, so greedy output
    is not one token repeated)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.float16)  # on meta: no memory, no time
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied head its own storage
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # inv_freq is computed at init
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    std = shape["hidden_size"] ** -0.5
    with torch.no_grad():
        for p in model.parameters():  # a tied weight is listed once
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float16).mul_(std))
    if device == "cuda":
        torch.cuda.empty_cache()
    return model.eval()


def build_graph(shape: dict, workdir: Path) -> tuple[object, dict]:
    from specexport.graphs.decoder import build_decoder

    start = time.perf_counter()
    model = make_model(shape)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    init_seconds = time.perf_counter() - start
    result = build_decoder(model, workdir, MAX_CONTEXT)
    params = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    info = {
        "parameters": params,
        "tied_embedding": tied,
        "init_seconds": round(init_seconds, 1),
        "build_seconds": round(result.seconds, 1),
        "graph_bytes": result.bytes,
        "nodes": result.num_nodes,
        "weight_bytes": weight_bytes(result),
    }
    return result, info


def weight_bytes(result) -> int:
    """Size of the graph's external weights file: what a decode step reads (the tied head reads
    the whole embedding table)."""
    from specexport.graphs.writer import DATA_NAME

    return (result.path.parent / DATA_NAME).stat().st_size


def open_model(result, provider: str):
    from specexport_runtime.engine import OrtModel, SessionConfig

    start = time.perf_counter()
    model = OrtModel(result.path, result.spec, MAX_CONTEXT, SessionConfig(provider=provider))
    return model, round(time.perf_counter() - start, 1)


def per_call(model, rng: np.random.Generator, iterations: int, deadline: float) -> dict:
    """Median wall time of one forward at past PAST per S, and row 0 of S rows vs S=1."""
    V = model.spec.embedding_rows
    prompt = rng.integers(3, V, PAST).tolist()
    tokens = rng.integers(3, V, max(SEQS)).tolist()
    model.reset()
    model.forward(prompt)
    by_seq, reference = {}, None
    for S in SEQS:
        times = []
        for i in range(iterations + 2):  # two warm-up calls
            model.truncate(PAST)
            start = time.perf_counter()
            logits = model.forward(tokens[:S], last_rows=S)
            if i >= 2:
                times.append(time.perf_counter() - start)
            if time.perf_counter() > deadline and times:
                break
        row0 = np.array(logits[0])
        entry = {
            "median_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3,
            "calls": len(times),
            "logits_bytes_to_host": S * V * 4,
        }
        if reference is None:
            reference = row0
        else:
            entry.update(
                row0_max_abs_diff_vs_s1=float(np.abs(row0 - reference).max()),
                row0_argmax_equal_s1=bool(row0.argmax() == reference.argmax()),
            )
        by_seq[str(S)] = entry
    model.reset()
    return {"past": PAST, "by_seq": by_seq}


def drive(loop, prompt: list[int], n: int, models: list) -> dict:
    """Run the loop to n new tokens; time it after the prefill and the first round (warm-up,
    and a draft's catch-up on the prompt), splitting ONNX Runtime's time from the rest."""
    rounds = loop.rounds(prompt, MAX_CONTEXT)
    tokens = next(rounds) + next(rounds)
    ort0 = sum(m.stats.seconds for m in models)
    start, count, timed = time.perf_counter(), 0, 0
    for new in rounds:
        tokens += new
        count += 1
        timed += len(new)
        if len(tokens) >= n:
            break
    wall = time.perf_counter() - start
    ort_seconds = sum(m.stats.seconds for m in models) - ort0
    return {
        "tokens": tokens[:n],
        "distinct_tokens": len(set(tokens[:n])),
        "timed_tokens": timed,
        "rounds": count,
        "seconds": round(wall, 3),
        "tokens_per_second": timed / wall,
        "ms_per_token": wall / timed * 1e3,
        "ort_seconds": round(ort_seconds, 3),
        "outside_ort_ms_per_round": (wall - ort_seconds) / count * 1e3,
    }


def target_only(model, prompt: list[int]) -> dict:
    from specexport_runtime.config import GeneratorConfig
    from specexport_runtime.generator import LoopSetup, SpeculativeLoop
    from specexport_runtime.proposers import NoProposer

    options = GeneratorConfig(max_new_tokens=NEW_TOKENS, speculative=False)
    loop = SpeculativeLoop(LoopSetup(model, NoProposer(), options, np.random.default_rng(0)))
    return drive(loop, prompt, NEW_TOKENS, [model])


def self_draft(target, draft, prompt: list[int], baseline: dict) -> dict:
    from specexport_runtime.config import GeneratorConfig
    from specexport_runtime.generator import GenerationStats, LoopSetup, SpeculativeLoop
    from specexport_runtime.proposers import DraftModelProposer

    stats = GenerationStats()
    options = GeneratorConfig(max_new_tokens=NEW_TOKENS, gamma=GAMMA)
    proposer = DraftModelProposer(draft, target.spec.embedding_rows)
    loop = SpeculativeLoop(LoopSetup(target, proposer, options, np.random.default_rng(0), stats=stats))
    result = drive(loop, prompt, NEW_TOKENS, [target, draft])
    speedup = result["tokens_per_second"] / baseline["tokens_per_second"]
    result.update(
        gamma=GAMMA,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted_length=stats.mean_accepted_length,
        equal_to_target_only=result["tokens"] == baseline["tokens"],
        speedup=speedup,
        max_speedup=MAX_SPEEDUP,
        ok=bool(speedup <= MAX_SPEEDUP),
    )
    return result


# --------------------------------------------------------------------------- the probe


class Probe:
    """Runs the parts in order, each after asking the budget, saving the report after each."""

    def __init__(
        self, provider: str, shape_name: str, budget, gpu_name: str | None, out: dict, save: Callable[[], None]
    ):
        self.provider, self.shape_name, self.budget, self.gpu_name = provider, shape_name, budget, gpu_name
        self.out, self.save = out, save
        self.needs = NEEDS_1B if shape_name == "llama-3.2-1b" else NEEDS_TINY
        self.out.update(
            shape_name=shape_name,
            shape=SHAPES[shape_name],
            dtype="fp16",
            graph="fused",
            simulated=provider != "cuda",
            max_context=MAX_CONTEXT,
        )

    def part(self, name: str, needs: float, fn: Callable[[], dict]) -> dict | None:
        if not self.budget.allows(f"probe {name}", needs):
            self.out[name] = {"skipped": "budget"}
            return None
        try:
            self.out[name] = fn()
        except Exception as exc:  # the error text is the result (e.g. a CUDA graph the EP refuses)
            from devicecheck.report import error_record

            self.out[name] = {**error_record(exc), "ok": False}
            print(f"probe {name}: FAILED {self.out[name]['error']}", flush=True)
        self.save()
        return self.out[name]

    def run(self) -> None:
        with tempfile.TemporaryDirectory(prefix="device-check-probe-") as workdir:  # the 1B graph: GBs, removed after
            self._run(Path(workdir))

    def _run(self, workdir: Path) -> None:
        n = self.needs
        built = {}

        def build() -> dict:
            result, info = build_graph(SHAPES[self.shape_name], workdir)
            built["result"] = result
            return info

        if not self.part("build", n["build"] + n["session"] + n["per_call"], build) or "result" not in built:
            return
        result = built["result"]
        rng = np.random.default_rng(0)
        prompt = rng.integers(3, result.spec.embedding_rows, PAST).tolist()
        target, seconds = open_model(result, self.provider)
        self.out["build"]["target_session_seconds"] = seconds
        session = max(seconds, 1.0)
        self.out["bandwidth_bound"] = self.bandwidth(result)
        calls = self.part(
            "per_call", n["per_call"], lambda: per_call(target, rng, 30, time.perf_counter() + n["per_call"])
        )
        base = self.part("target_only", n["target_only"], lambda: target_only(target, prompt))
        if base and "tokens_per_second" in base:
            self.part("self_draft", session + n["run"], lambda: self.with_draft(result, target, prompt, base))
        plain = (calls or {}).get("by_seq", {}).get("1", {}).get("median_ms")
        self.part(
            "cuda_graph", session + n["run"], lambda: cuda_graph(result, self.provider, target, prompt, 32, plain)
        )
        self.out["bandwidth_bound"] = self.bandwidth(result)

    def with_draft(self, result, target, prompt: list[int], base: dict) -> dict:
        draft, seconds = open_model(result, self.provider)
        try:
            out = self_draft(target, draft, prompt, base)
        finally:
            del draft
            gc.collect()
        out["draft_session_seconds"] = seconds
        return out

    def bandwidth(self, result) -> dict:
        spec = result.spec
        weights = weight_bytes(result)
        kv = 2 * spec.num_layers * PAST * spec.num_kv_heads * spec.head_dim * 2
        bw, source = bandwidth_for(self.gpu_name) if self.provider == "cuda" else (None, None)
        out = {
            "gpu": self.gpu_name,
            "weight_bytes_per_token": weights,
            "kv_bytes_per_token_at_past": kv,
            "bandwidth_bytes_per_second": bw,
            "bandwidth_source": source or "unknown GPU: no figure",
            "min_ms_per_token": (weights + kv) / bw * 1e3 if bw else None,
            "max_tokens_per_second": bw / (weights + kv) if bw else None,
        }
        decode = self.out.get("per_call", {}).get("by_seq", {}).get("1", {}).get("median_ms")
        if bw and decode:
            out["decode_fraction_of_bound"] = out["min_ms_per_token"] / decode
        return out


def run_probe(
    provider: str, shape_name: str, budget, gpu_name: str | None, out: dict, save: Callable[[], None]
) -> dict:
    Probe(provider, shape_name, budget, gpu_name, out, save).run()
    for key in ("target_only", "self_draft"):  # the first tokens are enough to read
        if "tokens" in out.get(key, {}):
            out[key]["first_tokens"] = out[key].pop("tokens")[:16]
    parts = [out.get(k, {}) for k in ("build", "per_call", "target_only", "self_draft")]
    out["ok"] = not any(p.get("error") for p in parts) and out.get("self_draft", {}).get("ok", True) is not False
    return out
