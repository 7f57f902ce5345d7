"""Round-to-nearest int8 / int4 targets of Qwen3.5 (Gated DeltaNet + gated attention): the
graph computes the quantized weights exactly, and an int8 target builds, validates and
speculates bit for bit.

The reference is independent of the code under test: the test quantizes and dequantizes every
linear weight itself (symmetric round-to-nearest, equations below) and runs transformers on
those weights. At accuracy_level 1 MatMulNBits computes in float32, so the graph matches that
reference to float32 summation noise, while both sit far from the float weights' logits on
HF's random init: its GDN decays exp(g) (g = -A softplus(a + dt_bias), A ~ U(0.01, 16)) are
about e^-10, so each row's output is about beta (q_t . k_t) v_t / sqrt(dk) of its own token,
whose relative error grows as 1 / |cos(q_t, k_t)| where q_t and k_t are nearly orthogonal, and
the gated RMSNorm then scales such a row up to full size (docs/validation.md).
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import make_model, save_hf_folder, write_recipe

from specexport.build.artifact import build_artifact
from specexport.build.validate import FeedRunner, reference_logits
from specexport.graphs.decoder import build_decoder
from specexport.graphs.quantized_target import QuantizedWeights
from specexport.recipe.load import load_recipe
from specexport_runtime.api import load

ARCH = "qwen3_5_text"
BLOCK = 32
FP32_TOL = 3e-4  # |logit diff| of the graph vs transformers, both on the same dequantized weights (tiny.FP32_BOUND)


def rtn_dequantized(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric round-to-nearest over blocks of BLOCK inputs, back to float32: per block
    scale = m / -2^(bits-1) with m its largest-magnitude value (sign kept), code
    q = clip(round(w / scale) + 2^(bits-1), 0, 2^bits - 1), weight scale * (q - 2^(bits-1))."""
    N, K = w.shape
    blocks = w.double().reshape(N, K // BLOCK, BLOCK)
    m = torch.gather(blocks, -1, blocks.abs().argmax(-1, keepdim=True))  # [N, nb, 1]
    half = 2 ** (bits - 1)
    scale = (m / -half).float().double()  # stored as float32
    q = torch.clamp(torch.round(blocks / scale.where(scale != 0, 1)) + half, 0, 2 * half - 1)  # an all-zero block: 0
    return (scale * (q - half)).reshape(N, K).float()


def dequantized_copy(model: torch.nn.Module, bits: int) -> torch.nn.Module:
    """Every nn.Linear at `bits`, the (untied) output head at 8 bits (the recipe's default
    head: int8), the embedding float."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(rtn_dequantized(module.weight, bits))
        ref.lm_head.weight = torch.nn.Parameter(rtn_dequantized(ref.lm_head.weight.detach().clone(), 8))
    return ref.eval()


def with_memory(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """GDN decays A ~ U(0.01, 0.3) instead of HF's U(0.01, 16): exp(g) of about 0.7-1, so each
    output row sums over many tokens, as a linear-attention layer is meant to."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = getattr(layer, "linear_attn", None)
            if mixer is not None:
                mixer.A_log.copy_(torch.empty(mixer.A_log.shape).uniform_(0.01, 0.3, generator=gen).log())
    return model


def graph_logits(model, precision: str | None, out: Path, ids: list[int]) -> np.ndarray:
    """A prefill and a 5-token verify call of the fused graph, MatMulNBits at accuracy_level 1
    (precision None: float weights): [len(ids), V]."""
    weights = None if precision is None else QuantizedWeights(precision, BLOCK, 1, "int8", "fp32", {})
    result = build_decoder(model, out, 512, weights=weights)
    runner = FeedRunner(result.path, result.spec)
    n0 = len(ids) - 5
    return np.concatenate([runner.run(ids[:n0], list(range(n0))), runner.run(ids[n0:], list(range(5)))])


def test_quantized_gdn_graph_computes_its_dequantized_weights(tmp_path):
    """int8 and int4 MatMulNBits on every projection (the GDN's in_proj q|k|v|z|b|a and out_proj,
    the gated attention's, the MLPs', the head): the logits of transformers on the test's own
    dequantized weights, on HF's init where those differ from the float logits by most of their
    range (quantization noise, not the graph). The prefill (65 rows) runs the chunked form, the
    verify (5 rows) the step recurrence."""
    model = make_model(ARCH)
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 300, 70)]
    float_logits = reference_logits(model, ids)
    for precision, bits in (("int8", 8), ("int4", 4)):
        ref = reference_logits(dequantized_copy(model, bits), ids)
        got = graph_logits(model, precision, tmp_path / precision, ids)
        assert np.abs(got - ref).max() < FP32_TOL, precision
        assert (got.argmax(-1) == ref.argmax(-1)).all(), precision
        noise = np.abs(ref - float_logits).max() / np.abs(float_logits).max()
        assert noise > 0.25, f"{precision}: HF's init no longer amplifies quantization noise ({noise:.3f})"


def test_chunked_gdn_prefill_of_a_repeated_prompt_with_slow_decays(tmp_path):
    """A float32 graph, one 251-row prefill call (the chunked form) of a 17-token probe repeated,
    GDN decays of with_memory: layer 0's keys repeat every 17 rows. U^-1 stays within 1, but the
    powers N^(2^j) of a product (I + N)(I + N^2)... reach ~5e7 (N^32, float64) before N^256 = 0,
    and float32 products of them cancel to garbage (max |diff| ~7.5 from row ~94 on); gdn._inverse
    forms no power, only blocks of U^-1."""
    model = with_memory(make_model(ARCH, seed=1))
    probe = [int(i) for i in np.random.default_rng(0).integers(3, 300, 17)]
    ids = (probe * 16)[:256]
    got = graph_logits(model, None, tmp_path / "g", ids)
    ref = reference_logits(model, ids)
    assert np.abs(got - ref).max() < FP32_TOL


@pytest.mark.slow  # a full build with validation and row checks, ~6 s of CPU
def test_int8_qwen3_5_target_validates_and_speculates_bit_for_bit(tmp_path):
    """A tiny int8 target whose GDN layers have memory builds (validation included), its rows are
    measured bitwise, and greedy n-gram speculation equals its own target-only decoding."""
    folder = save_hf_folder(with_memory(make_model(ARCH)), tmp_path / "hf")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        folder,
        {"proposer": "ngram", "ngram_sizes": [3, 2, 1]},
        name="tiny-qwen3_5-int8",
        graph="fused",
        precision="int8",
    )
    build_artifact(load_recipe(recipe), tmp_path / "a")
    target = json.loads((tmp_path / "a" / "manifest.json").read_text())["target"]
    assert target["precision"] == "int8" and target["exactness"] == "bitwise"
    validation = target["validation"]
    assert validation["argmax_agreement"] >= 0.75 and validation["rows"]["max_abs_diff"] == 0.0
    assert validation["tolerance"]["rel"] == 0.25  # the int8 class: a weak quantization would fail it
    gen = load(tmp_path / "a")
    for prompt in ([7, 150, 33, 299, 12, 260, 5], [40, 41, 42, 43, 44] * 4, [9, 77, 140, 200, 31]):
        off = gen.generate(prompt, max_new_tokens=48, speculative=False).token_ids
        assert len(off) > 8
        for gamma in (3, 8):
            assert gen.generate(prompt, max_new_tokens=48, proposer="ngram", gamma=gamma).token_ids == off


def report(probes: int = 3, length: int = 40) -> None:
    """The figures of docs/validation.md ("Round-to-nearest targets of hybrid families"), over
    random probes: max |logit diff| / max |float logit| and argmax agreement of the dequantized
    weights against the float ones (Qwen3.5 with HF's init and with_memory, seeds 0 and 1, then
    the other hybrid families' tiny models); and for the int8 graph at accuracy_level 4 the max
    |logit diff| between validation's unprepacked session and a prepacked one, as the runtime
    opens (ONNX Runtime quantizes MatMulNBits activations only in the prepacked one)."""
    from specexport_runtime.engine import SessionConfig, make_session

    rng = np.random.default_rng(0)
    ids = [[int(i) for i in rng.integers(3, 300, length)] for _ in range(probes)]
    cases = [(ARCH, seed, "HF init", lambda m: m) for seed in (0, 1)]
    cases += [(ARCH, seed, "with_memory", with_memory) for seed in (0, 1)]
    cases += [(arch, 0, "HF init", lambda m: m) for arch in ("lfm2", "granitemoehybrid", "nemotron_h", "falcon_h1")]
    for arch, seed, label, prepare in cases:
        model = prepare(make_model(arch, seed=seed))
        row = []
        for bits in (8, 4):
            ref = dequantized_copy(model, bits)
            diffs, agree = [], []
            for p in ids:
                want, got = reference_logits(model, p), reference_logits(ref, p)
                diffs.append(np.abs(got - want).max() / np.abs(want).max())
                agree.append((got.argmax(-1) == want.argmax(-1)).mean())
            row.append(f"int{bits} {max(diffs):.2f} / {np.mean(agree):.2f}")
        with tempfile.TemporaryDirectory() as tmp:
            result = build_decoder(
                model, Path(tmp), 128, weights=QuantizedWeights("int8", BLOCK, 4, "int8", "fp32", {})
            )
            logits = []
            for prepack in (False, True):
                runner = FeedRunner(result.path, result.spec)
                runner.session = make_session(result.path, SessionConfig(provider="cpu", prepack=prepack))
                logits.append(runner.run(ids[0], list(range(length))))
            gap = np.abs(logits[0] - logits[1]).max() / np.abs(logits[0]).max()
        print(f"{arch} {label}, seed {seed}: {', '.join(row)}; int8 level 4 prepacked vs not {gap:.2f}")


if __name__ == "__main__":
    report()
