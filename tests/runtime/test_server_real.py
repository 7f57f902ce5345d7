"""`specexport serve` on the real default artifact (SmolLM2-135M fp32 target + int8 self-draft):
through the official openai client, streaming and not, greedy output equals in-process and
target-only generation token for token for every proposer the artifact runs."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server_support import LiveServer  # noqa: E402

from specexport_runtime.api import load  # noqa: E402

pytestmark = pytest.mark.real

CHAT = [{"role": "user", "content": "Rewrite this more formally: we gotta ship the fix today or the demo breaks."}]
N = 48


@pytest.fixture(scope="module")
def served(real_artifact):
    server = LiveServer(load(real_artifact), max_queue=4)
    yield server
    server.close()


@pytest.fixture(scope="module")
def ref(real_artifact):
    return load(real_artifact)


@pytest.mark.parametrize("proposer", ["draft", "ngram", "hybrid", "suffix", "none"])
def test_real_server_equals_in_process(served, ref, proposer):
    client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    plain = ref.chat(CHAT, max_new_tokens=N, speculative=False)
    r = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=N,
        temperature=0,
        extra_body={"proposer": proposer, "return_token_ids": True},
    )
    assert r.choices[0].model_extra["token_ids"] == plain.token_ids
    assert r.choices[0].message.content == plain.text
    if proposer != "none":
        assert r.model_extra["speculative"]["drafted"] > 0
    stream = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=N, temperature=0, stream=True, extra_body={"proposer": proposer}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain.text
