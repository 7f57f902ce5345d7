"""Greedy exactness on the real default artifact (SmolLM2-135M fp32 target, int8 self-draft,
fused graphs, exactness bitwise: padded attention): every proposer (draft, n-gram, hybrid),
fixed and adaptive gamma, token for token."""

from __future__ import annotations

import pytest

from specexport_runtime.api import load

pytestmark = pytest.mark.real

N = 64
CODE = 'def fibonacci(n):\n    """Return the n-th Fibonacci number (0-indexed)."""\n'
CHAT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
COPY_EDIT = (
    "Fix the spelling and grammar of the text and repeat it.\n"
    "Text: Their going to the libary tomorow becuase they needs to return three book.\n"
    "Corrected text:"
)
CASES = {"code": CODE, "chat": CHAT, "copy-edit": COPY_EDIT}
SETTINGS = {
    "draft-gamma4": {"proposer": "draft", "gamma": 4},
    "draft-adaptive": {"proposer": "draft", "gamma": None},
    "ngram-gamma4": {"proposer": "ngram", "gamma": 4},
    "ngram-adaptive": {"proposer": "ngram", "gamma": None},
    "hybrid-gamma8": {"proposer": "hybrid", "gamma": 8},
    "hybrid-default": {},  # the artifact's own proposer and adaptive gamma (the default recipe: hybrid)
}


@pytest.fixture(scope="module")
def real_gen(real_artifact):
    return load(real_artifact)


def run(gen, prompt, **kwargs):
    if isinstance(prompt, list):
        return gen.chat(prompt, max_new_tokens=N, **kwargs)
    return gen.generate(prompt, max_new_tokens=N, **kwargs)


@pytest.fixture(scope="module")
def baselines(real_gen):
    """case -> its target-only run, made when a test first asks for it."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = run(real_gen, CASES[name], speculative=False)
        return cache[name]

    return get


# copy-edit (~15 s) runs in the slow pass; code and chat keep real greedy exactness in the default run
@pytest.mark.parametrize("case", ["code", "chat", pytest.param("copy-edit", marks=pytest.mark.slow)])
def test_real_greedy_speculative_equals_target_only(real_gen, baselines, case):
    base = baselines(case)
    assert len(base.token_ids) == N or base.finish_reason == "eos"
    assert base.stats.drafted == 0
    for name, kwargs in SETTINGS.items():
        result = run(real_gen, CASES[case], **kwargs)
        assert result.token_ids == base.token_ids, f"{case} {name}: speculative output differs from target-only"
        assert result.text == base.text and result.finish_reason == base.finish_reason
        s = result.stats
        assert s.rounds == s.corrections + s.bonus
        assert 1 + s.accepted + s.rounds + s.plain_steps >= s.new_tokens == len(result.token_ids)
        if kwargs.get("gamma") is not None:
            assert s.drafted > 0 or kwargs["proposer"] == "ngram"


def test_real_target_is_measured_bitwise(real_gen):
    """The default recipe's target (exactness bitwise) pads its attention and measured bitwise."""
    target = real_gen.manifest.target
    assert (target.exactness, target.cache_pad, target.min_rows) == ("bitwise", 1, 1)
    assert target.validation["rows"]["bitwise"] and target.validation["rows"]["padding"] == "padded attention"


def test_real_int8_self_draft_acceptance(real_gen):
    assert real_gen.manifest.draft is not None and real_gen.manifest.draft.precision == "int8"
    result = real_gen.generate(CODE, max_new_tokens=N, proposer="draft", gamma=4)
    s = result.stats
    assert s.drafted >= 4 * 8
    assert s.acceptance_rate > 0.7, f"int8 self-draft acceptance {s.acceptance_rate:.2f} on code"
    assert s.mean_accepted_length > 2.0
