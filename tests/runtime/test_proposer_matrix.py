"""The proposer matrix: every registered proposer (the built-in ones and tests/extra_proposers)
against the same checks, on a tiny artifact of each draft kind it runs with. A proposer added
to the registry is tested here without a line of test code; one whose needs no tiny artifact
meets fails here until one is added to ARTIFACTS.

Checks: greedy output equals target-only output (fixed and adaptive gamma, a repetitive and a
plain prompt, and at the context limit); the round counters add up under sampling; a fixed
gamma bounds the drafts of a proposer the loop does not ask when drafting is off; a free
proposer never calls the draft model; an abandoned generation leaves the generator usable;
the factory returns a Proposer named as registered.
"""

from __future__ import annotations

import pytest
from extra_proposers import TEST_PROPOSERS

from specexport_runtime import registry
from specexport_runtime.contract import ASSISTANT, DECODER, DFLASH_BLOCK, EAGLE3_HEAD, MTP
from specexport_runtime.proposers import Proposer

# a tiny artifact (conftest.tiny_artifacts kind) per draft graph kind: None = no draft graph
ARTIFACTS = {
    None: "ngram",
    DECODER: "noisy",
    EAGLE3_HEAD: "eagle3",
    DFLASH_BLOCK: "dflash",
    ASSISTANT: "assistant",
    MTP: "mtp",
}
SPECS = (*registry.PROPOSERS.values(), *TEST_PROPOSERS)
PROMPTS = ("def add(a, b):", [40, 41, 42, 43, 44] * 4)
NEW = 40


def _cases(specs=SPECS, free_only: bool = False) -> list:
    """(proposer, artifact kind) for every draft kind each proposer runs with."""
    cases = []
    for spec in specs:
        if free_only and not spec.free:
            continue
        for kind in (DECODER,) if free_only else spec.needs or (None,):
            artifact = ARTIFACTS.get(kind, f"no tiny artifact for draft kind {kind!r}")
            cases.append(pytest.param(spec.name, artifact, id=f"{spec.name}-{artifact}"))
    return cases


@pytest.fixture(scope="module", autouse=True)
def test_proposers_registered():
    with registry.extended(*TEST_PROPOSERS):
        yield


@pytest.fixture
def gen(gens, request):
    kind = request.node.callspec.params["kind"]
    if kind not in ARTIFACTS.values():
        pytest.fail(f"{request.node.callspec.params['name']}: {kind} (add one to ARTIFACTS in this file)")
    generator = gens(kind)
    generator.forget_history()
    yield generator
    generator.forget_history()


def check_counts(result, name: str) -> None:
    st = result.stats
    assert st.new_tokens == len(result.token_ids)
    assert st.accepted <= st.drafted and st.corrections + st.bonus == st.rounds == len(st.round_sizes)
    assert [sum(v[i] for v in st.by_source.values()) for i in range(3)] == [st.rounds, st.drafted, st.accepted]
    if not registry.get(name).speculative:
        assert st.drafted == st.rounds == 0


def test_every_registered_proposer_has_a_test_artifact():
    """Each draft kind a registered proposer needs has a tiny artifact in ARTIFACTS."""
    missing = {spec.name: kind for spec in SPECS for kind in spec.needs if kind not in ARTIFACTS}
    assert not missing, f"no tiny artifact for these proposers' draft kinds: {missing}"
    assert {s.name for s in SPECS} >= set(registry.names())


@pytest.mark.parametrize("name, kind", _cases())
def test_the_factory_builds_the_registered_proposer(gen, name, kind):
    proposer = gen.build_proposer(name, gen.config.replace(proposer=name))
    assert isinstance(proposer, Proposer) and proposer.name == name


@pytest.mark.parametrize("name, kind", _cases())
def test_greedy_output_is_the_targets(gen, name, kind):
    proposer = gen.build_proposer(name, gen.config.replace(proposer=name))
    for prompt in PROMPTS:
        base = gen.generate(prompt, max_new_tokens=NEW, speculative=False).token_ids
        for gamma in (3, None):
            gen.forget_history()
            result = gen.generate(prompt, max_new_tokens=NEW, proposer=name, gamma=gamma)
            assert result.token_ids == base, f"{name} gamma={gamma} prompt {prompt!r}"
            check_counts(result, name)
            if gamma is not None and not proposer.free_when_off:
                assert all(k <= gamma for k, _ in result.stats.round_sizes)


@pytest.mark.parametrize("name, kind", _cases())
def test_greedy_at_the_context_limit(gen, name, kind):
    """A repetitive prompt 6 tokens short of max_context: drafts are cut to the room left and
    the output is the target's up to the context's end."""
    prompt = [40, 41, 42, 43, 44] * ((gen.manifest.max_context - 6) // 5)
    base = gen.generate(prompt, max_new_tokens=50, speculative=False)
    result = gen.generate(prompt, max_new_tokens=50, proposer=name, gamma=4)
    assert result.token_ids == base.token_ids and result.finish_reason == base.finish_reason


@pytest.mark.parametrize("name, kind", _cases())
def test_sampling_counts_add_up(gen, name, kind):
    for prompt in PROMPTS:
        result = gen.generate(prompt, max_new_tokens=NEW, proposer=name, gamma=3, temperature=1.0, top_k=40, seed=7)
        check_counts(result, name)
        assert all(0 <= t < gen.manifest.target.embedding_rows for t in result.token_ids)


@pytest.mark.parametrize("name, kind", _cases())
def test_an_abandoned_generation_leaves_the_generator_usable(gen, name, kind):
    prompt = PROMPTS[1]
    base = gen.generate(prompt, max_new_tokens=20, speculative=False).token_ids
    run = gen.events(prompt, max_new_tokens=NEW, proposer=name, gamma=3)
    next(run)
    run.close()
    assert gen.generate(prompt, max_new_tokens=20, proposer=name, gamma=3).token_ids == base


@pytest.mark.parametrize("name, kind", _cases(free_only=True))
def test_a_free_proposer_never_calls_the_draft_model(gen, name, kind):
    """registry `free`: on an artifact with a draft model, its generations leave the draft alone."""
    before = gen.draft.stats.calls
    for prompt in PROMPTS:
        gen.generate(prompt, max_new_tokens=NEW, proposer=name, gamma=3)
    assert gen.draft.stats.calls == before
