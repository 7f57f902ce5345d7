"""Speculation on a hybrid target (feature recurrent_state): LFM2's gated convolutions, Granite
4.0-H's and Nemotron-H's Mamba2 mixers and Qwen3.5's Gated DeltaNet beside attention layers,
tiny random-init models shaped like the real checkpoints (tests/tiny.py).

Every proposer kind (n-gram, suffix, hybrid, a separate draft model, the int8 self-draft whose
own state rolls back too) gives greedy output equal to target-only output, and both equal
transformers' own greedy tokens; a proposer that drafts wrong tokens at known positions forces
rejections in every round shape; a rollback after a rejection leaves the state of the accepted
prefix (a test that fails if the post-draft state were kept); a constrained generation equals
its unspeculated self; sampling keeps the target's law.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from exactness_support import check_first_two_tokens_follow_target
from test_rollback import RandomProposer, run_loop
from tiny import build_tiny_artifact

from specexport_runtime.api import load
from specexport_runtime.engine import OrtModel, SessionConfig
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.manifest import read_manifest

ARCHS = ["lfm2", "granitemoehybrid", "qwen3_5_text", "nemotron_h", "falcon_h1"]
KINDS = ["ngram", "noisy", "noisy-fused", "int8-fused"]  # portable / fused targets, every draft kind
# the default run: one case per family and draft kind; the rest behind `slow` (.ci/run's second pass)
DEFAULT = {
    ("lfm2", "noisy-fused"),
    ("lfm2", "ngram"),
    ("granitemoehybrid", "noisy"),
    ("granitemoehybrid", "int8-fused"),
    ("qwen3_5_text", "noisy-fused"),
    ("nemotron_h", "int8-fused"),
    ("falcon_h1", "noisy-fused"),
}


def cases(kinds, seeds=(None,)) -> list:
    """(arch, kind[, seed]) parameters, those outside DEFAULT (or past seed 0) marked slow."""
    out = []
    for arch in ARCHS:
        for kind in kinds:
            for seed in seeds:
                values = (arch, kind) if seed is None else (arch, kind, seed)
                slow = (arch, kind) not in DEFAULT or (seed or 0) > 0
                out.append(pytest.param(*values, marks=pytest.mark.slow) if slow else values)
    return out


GENERATE = 48
PROMPTS = [[7, 150, 33, 299, 12, 260, 5], [40, 41, 42, 43, 44] * 4]
LONG_PROMPTS = {  # no end of sequence within 160 greedy tokens of each tiny model
    "lfm2": [[9, 77, 140, 200, 31], [40, 41, 42, 43, 44] * 4],
    "granitemoehybrid": [[100, 101, 102, 103], [250, 3, 17, 88, 121, 64]],
    "qwen3_5_text": [[9, 77, 140, 200, 31], [250, 3, 17, 88, 121, 64]],
    "nemotron_h": [[9, 77, 140, 200, 31], [40, 41, 42, 43, 44] * 4],
    "falcon_h1": [[9, 77, 140, 200, 31], [40, 41, 42, 43, 44] * 4],
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """(arch, kind) -> a tiny artifact of 512 positions (prompts cross recurrent.MAX_CALL_ROWS)."""
    built: dict[tuple[str, str], object] = {}

    def get(arch: str, kind: str):
        if (arch, kind) not in built:
            work = tmp_path_factory.mktemp(f"{arch}-{kind}")
            built[arch, kind] = build_tiny_artifact(work, kind, arch=arch, max_context=512)
        return built[arch, kind]

    return get


@pytest.fixture(scope="module")
def gens(artifacts):
    cache: dict = {}

    def get(arch: str, kind: str):
        if (arch, kind) not in cache:
            cache[arch, kind] = load(artifacts(arch, kind))
        return cache[arch, kind]

    return get


_REFERENCE: dict = {}


def _hf_greedy(arch: str, folder, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens (every artifact of a family saves the same seeded weights, so
    one reference per family, prompt and length serves them all)."""
    from transformers import AutoModelForCausalLM

    key = (arch, tuple(ids), n)
    if key not in _REFERENCE:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)
        new = out[0, len(ids) :].tolist()
        _REFERENCE[key] = new[: new.index(2)] if 2 in new else new
    return _REFERENCE[key]


@pytest.mark.parametrize("arch, kind", cases(KINDS))
def test_every_proposer_equals_target_only_and_transformers(gens, artifacts, arch, kind):
    gen = gens(arch, kind)
    m = gen.manifest
    assert m.target.states and "recurrent_state" in m.graph_features
    folder = artifacts(arch, kind).parent / "target-hf"
    names = ["ngram", "suffix"] + (["draft", "hybrid"] if m.draft is not None else [])
    for prompt in PROMPTS:
        want = _hf_greedy(arch, folder, prompt, GENERATE)
        off = gen.generate(prompt, max_new_tokens=GENERATE, speculative=False)
        assert list(off.token_ids) == want, f"{kind}: target-only differs from transformers"
        for name in names:
            on = gen.generate(prompt, max_new_tokens=GENERATE, proposer=name, gamma=4)
            assert list(on.token_ids) == want, f"{kind} {name}: speculative output differs"
            if name == "draft":
                assert on.stats.drafted > 0 and on.stats.corrections > 0


@pytest.mark.parametrize("arch, kind, seed", cases(KINDS, seeds=range(3)))
def test_forced_rejections_at_every_position_stay_exact(gens, arch, kind, seed):
    """Random drafts: a random number of right tokens, then wrong ones; 120 tokens, gamma 6."""
    gen = gens(arch, kind)
    prompt = LONG_PROMPTS[arch][seed % 2]
    n = 120
    reference = gen.generate(prompt, max_new_tokens=n + 40, speculative=False).token_ids
    assert len(reference) == n + 40
    proposer = RandomProposer(reference, gen.target, gen.manifest.target.vocab_size, seed)
    out, stats, log, cursors = run_loop(gen, proposer, prompt, n, gamma=6)
    assert out[:n] == reference[:n], "a rejected draft's recurrent state leaked into later rounds"
    assert log == proposer.expected
    assert stats.corrections > 5 and stats.bonus > 0
    assert all(cursor == committed - 1 for cursor, committed in cursors)


@pytest.mark.parametrize("arch, kind", sorted(DEFAULT))  # portable and fused targets of each family
def test_rollback_restores_the_state_of_the_accepted_prefix(artifacts, arch, kind):
    """A verify call of 1 + 4 rows whose last 3 are rejected, then the correction: the next
    logits equal a fresh model's that never saw the rejected tokens. Keeping the post-draft
    state (the conv window after the rejected rows) gives other logits, which this checks too."""
    root = artifacts(arch, kind)
    m = read_manifest(root)
    spec = m.target.graph_spec()
    prompt = PROMPTS[0] * 3
    model = OrtModel(root / m.target.graph, spec, m.max_context, SessionConfig(), min_rows=m.target.min_rows)
    model.forward(prompt)
    P = model.length
    model.forward([11, 12, 13, 14, 15], last_rows=5)  # row 0 accepted, rows 1.. rejected
    model.truncate(P + 2)
    got = model.forward([99]).copy()

    fresh = OrtModel(root / m.target.graph, spec, m.max_context, SessionConfig(), min_rows=m.target.min_rows)
    fresh.forward(prompt + [11, 12])
    want = fresh.forward([99]).copy()
    # conv rows and the step recurrence's (scan.step_or_chunk) do not depend on the call's size
    assert m.target.exactness == "bitwise"
    np.testing.assert_array_equal(got, want)

    stale = OrtModel(root / m.target.graph, spec, m.max_context, SessionConfig(), min_rows=m.target.min_rows)
    stale.forward(prompt + [11, 12, 13, 14, 15])
    post_draft = [s.copy() for s in stale.states.state(P + 5)]
    stale.truncate(P + 2)
    for kept, post in zip(stale.states.state(P + 2), post_draft):  # as if the cursor alone moved back
        kept[...] = post
    assert np.abs(stale.forward([99]) - want).max() > 1e-3, "the conv state does not reach the logits"


def test_a_rollback_past_the_kept_states_is_refused(artifacts):
    root = artifacts("lfm2", "ngram")
    m = read_manifest(root)
    model = OrtModel(root / m.target.graph, m.target.graph_spec(), m.max_context, SessionConfig(), max_rows=8)
    for t in range(20):
        model.forward([5 + t])
    model.truncate(12)  # 8 back: kept
    with pytest.raises(InvalidArgument, match="recurrent state after 2 tokens is not kept"):
        model.truncate(2)
    model.truncate(0)  # the empty prefix's state is zeros: always kept
    assert model.length == 0


@pytest.mark.parametrize("arch", ["granitemoehybrid", pytest.param("lfm2", marks=pytest.mark.slow)])
def test_constrained_generation_on_a_hybrid(gens, arch):
    from specexport_runtime.structured import Grammar

    gen = gens(arch, "noisy")
    grammar = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    for prompt in PROMPTS:
        off = gen.generate(prompt, max_new_tokens=40, grammar=grammar, speculative=False)
        for proposer in ("draft", "ngram"):
            on = gen.generate(prompt, max_new_tokens=40, grammar=grammar, proposer=proposer, gamma=4)
            assert list(on.token_ids) == list(off.token_ids), proposer
        assert off.text.startswith("{")


@pytest.mark.slow  # ~16 s a family; greedy exactness of every hybrid stays in the default run
@pytest.mark.parametrize("arch", ["granitemoehybrid", "lfm2"])
def test_sampling_on_a_hybrid_keeps_the_targets_law(gens, arch):
    """Temperature 1 with a draft model: the first two tokens (the second from the first
    speculative round: accepted draft, correction or bonus) against the exact target law and
    against target-only samples (exactness_support: chi-square and the two-sample TV bound)."""
    gen = gens(arch, "noisy")
    check_first_two_tokens_follow_target(gen, PROMPTS[0], "draft", N=1000)


@pytest.mark.parametrize(
    "arch, kind",
    [
        ("lfm2", "noisy-fused"),
        ("granitemoehybrid", "noisy"),
        ("qwen3_5_text", "noisy-fused"),
        ("nemotron_h", "int8-fused"),
        ("falcon_h1", "noisy-fused"),
    ],
)
def test_a_prompt_longer_than_one_call_prefills_in_order(gens, artifacts, arch, kind):
    """A 300-token prompt runs as calls of at most recurrent.MAX_CALL_ROWS rows, the state carried
    from one to the next: greedy tokens equal transformers' one-pass forward, speculation on and off."""
    from specexport_runtime.recurrent import MAX_CALL_ROWS

    gen = gens(arch, kind)
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 300, size=300)]
    assert len(prompt) > MAX_CALL_ROWS
    want = _hf_greedy(arch, artifacts(arch, kind).parent / "target-hf", prompt, 24)
    assert list(gen.generate(prompt, max_new_tokens=24, speculative=False).token_ids) == want
    assert list(gen.generate(prompt, max_new_tokens=24, proposer="draft", gamma=4).token_ids) == want


@pytest.mark.parametrize("arch, kind", [("granitemoehybrid", "noisy"), ("qwen3_5_text", "noisy-fused")])
def test_the_step_and_chunked_forms_agree(artifacts, arch, kind):
    """A scan mixer runs its chunked form on calls of more than recurrent.STEP_ROWS rows and its
    step recurrence on shorter ones: 100 rows in one call and the same rows in calls of at most
    STEP_ROWS give the same logits within 1e-4 (float32 sums in other orders), and the states they
    leave give the same next rows."""
    from specexport_runtime.recurrent import STEP_ROWS

    root = artifacts(arch, kind)
    m = read_manifest(root)
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 300, size=100)]
    assert len(ids) > STEP_ROWS

    def run(pieces: list[list[int]]) -> np.ndarray:
        model = OrtModel(root / m.target.graph, m.target.graph_spec(), m.max_context, SessionConfig())
        for p in pieces[:-1]:
            model.forward(p)
        rows = model.forward(pieces[-1], last_rows=40).copy()  # the last 40 of the 100 rows
        return np.concatenate([rows, model.forward([7, 8], last_rows=2)])

    chunked = run([ids])  # its last 40 rows, then 2 more
    stepped = run([ids[:60], ids[60:]])
    assert not np.array_equal(chunked, stepped)  # the forms differ (else this checks one form twice)
    np.testing.assert_allclose(stepped, chunked, atol=1e-4, rtol=0)


def test_a_recurrent_model_keeps_states_for_its_longest_verify_call(gens):
    """The runtime opens a recurrent model with max_rows 1 + max_gamma (not the engine's 64): the
    state after each of the last max_rows + 1 positions, 2 max_gamma + 4 positions in all (what
    specexport plan counts)."""
    from specexport.plan.sizes import state_positions

    gen = gens("granitemoehybrid", "noisy")
    m, target = gen.manifest, gen.target
    assert target.max_rows == max(m.max_gamma + 1, m.target.min_rows) < 64
    kept = sum(r.shape[0] + z.shape[0] for r, z in zip(target.states.ring, target.states.zeros)) // len(m.target.states)
    assert kept == state_positions(m.max_gamma)


@pytest.mark.parametrize(
    "arch",
    [
        "granitemoehybrid",
        "lfm2",
        pytest.param("nemotron_h", marks=pytest.mark.slow),
        pytest.param("falcon_h1", marks=pytest.mark.slow),
    ],
)
def test_an_int8_hybrid_target_speculates_bit_for_bit(artifacts, arch):
    """An int8 (MatMulNBits) target of a hybrid, the mixers' projections quantized too: rows
    measured bitwise, and greedy speculation equals its own target-only decoding."""
    gen = load(artifacts(arch, "int8-target"))
    assert gen.manifest.target.exactness == "bitwise" and gen.manifest.target.precision == "int8"
    for prompt in [*PROMPTS, LONG_PROMPTS[arch][0]]:
        off = gen.generate(prompt, max_new_tokens=GENERATE, speculative=False).token_ids
        for gamma in (3, 8):
            assert gen.generate(prompt, max_new_tokens=GENERATE, proposer="ngram", gamma=gamma).token_ids == off
