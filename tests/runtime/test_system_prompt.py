"""A system prompt prefilled at build time (specexport/build/prompt.py, runtime system_prompt.py):
the first request with it restores the stored rows and gives exactly the tokens (and each token's
log-probability) of a generator without a pool that prefills it at run time, for both cache
layouts and an EAGLE-3 head, greedy and seeded; nothing is read at load; a tampered file is
refused in one line; rows of another graph or another machine's kernels are never seeded."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from specexport.recipe.reader import with_overrides
from specexport_runtime.api import load
from specexport_runtime.errors import ArtifactError, ChecksumError
from specexport_runtime.manifest import read_manifest, sha256_file, verify_files

# about 60 ids of the tiny tokenizer (the tiny context is 256)
SYSTEM = "You are a careful assistant for a code editor. Answer briefly, in plain words, and show code."
TURNS = ["def add(a, b):", "Now for three."]
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 11}


@pytest.fixture(scope="module")
def stored(tiny_artifacts, tmp_path_factory):
    """kind -> a copy of the tiny artifact with SYSTEM stored by the build's own stage."""
    from specexport.build.prompt import store_system_prompt

    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"sys-{kind}") / "artifact"
            shutil.copytree(tiny_artifacts[kind], root)
            store_system_prompt(root, SYSTEM, lambda _: None, threads=1)
            cache[kind] = root
        return cache[kind]

    return get


def chat(gen, settings: dict, turns=TURNS):
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        r = gen.chat(messages, max_new_tokens=12, logprobs=0, **settings)
        out.append((r.token_ids, r.logprobs, r.stats.cached_tokens))
        messages.append({"role": "assistant", "content": r.text})
    return out


@pytest.mark.parametrize("kind", ["noisy", "noisy-fused", "eagle3"], ids=["time_major", "head_major_inplace", "eagle3"])
@pytest.mark.parametrize("settings", [{}, SEEDED], ids=["greedy", "seeded"])
def test_the_first_request_restores_the_stored_prompt_and_equals_a_cold_prefill(stored, kind, settings):
    root = stored(kind)
    n = read_manifest(root).system_prompt.tokens
    warm, cold = load(root, threads=1), load(root, threads=1, config={"prefix_cache_bytes": 0})
    got, want = chat(warm, settings), chat(cold, settings)
    assert [(ids, lp) for ids, lp, _ in got] == [(ids, lp) for ids, lp, _ in want]
    assert got[0][2] >= n - 1 > 0  # the very first request skipped the system prompt's prefill
    assert all(c == 0 for _, _, c in want)
    info = warm.prefix_cache.describe()["system_prompt"]
    assert info["checked"] and info["refused"] is None
    # each file read once: later turns find the first turn's rows in the pool
    assert info["restored"]["target"] == 1 and set(info["restored"].values()) == {1}


def test_the_stored_ids_are_what_a_chat_renders(stored):
    root = stored("noisy")
    gen = load(root, threads=1)
    ids = np.load(root / "system_prompt" / "ids.npy")
    chat_ids = gen.codec.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}])
    assert list(ids) == chat_ids[: len(ids)] and len(ids) < len(chat_ids)
    assert (root / "system_prompt" / "prompt.txt").read_text(encoding="utf-8") == SYSTEM


def test_nothing_is_read_at_load_and_a_tampered_file_is_refused(stored, tmp_path):
    root = tmp_path / "artifact"
    shutil.copytree(stored("noisy"), root)
    rows = root / "system_prompt" / "target.npy"
    data = bytearray(rows.read_bytes())
    data[-1] ^= 1
    rows.write_bytes(bytes(data))
    gen = load(root, threads=1)  # checksums verified, but not the stored rows': lazy
    other = gen.generate("def add(a, b):", max_new_tokens=4)  # a prompt without the system prompt
    assert len(other.token_ids) == 4
    with pytest.raises(ChecksumError, match=r"checksum mismatch for 'system_prompt/target.npy'") as exc:
        chat(gen, {}, TURNS[:1])
    assert "\n" not in str(exc.value)
    with pytest.raises(ChecksumError):  # the whole artifact check (inspect, sign) covers it too
        verify_files(root, read_manifest(root))


def test_rows_of_another_graph_are_refused_at_load(stored, tmp_path):
    root = tmp_path / "artifact"
    shutil.copytree(stored("noisy"), root)
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    data["system_prompt"]["built_with"]["target"]["min_rows"] = 1 + data["target"].get("min_rows", 1)
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=r"system prompt's target rows were built with min_rows") as exc:
        load(root, threads=1)
    assert "\n" not in str(exc.value)


def _off_by_one_ulp(stored, kind: str, tmp_path):
    """A copy of the artifact whose stored target rows are one ulp off (as another CPU's kernels
    may give), its manifest's checksum updated."""
    root = tmp_path / "artifact"
    shutil.copytree(stored(kind), root)
    rows = root / "system_prompt" / "target.npy"
    np.save(rows, np.nextafter(np.load(rows), np.float32(np.inf)))
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    data["files"]["system_prompt/target.npy"] = sha256_file(rows)
    path.write_text(json.dumps(data))
    return root


def test_rows_this_machine_does_not_compute_are_not_used(stored, tmp_path):
    """The check (the row the prefill's call recomputes) refuses them: the same request prefills
    again from row 0, and reports nothing cached."""
    root = _off_by_one_ulp(stored, "noisy", tmp_path)
    warm, cold = load(root, threads=1), load(root, threads=1, config={"prefix_cache_bytes": 0})
    got, want = chat(warm, {}), chat(cold, {})
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want] and got[0][2] == 0
    info = warm.prefix_cache.describe()
    assert "differ from the stored ones" in info["system_prompt"]["refused"] and not info["system_prompt"]["checked"]
    assert info["cached_tokens"] == sum(c for _, _, c in got)  # the refused request's rows are not counted


def test_batch_slots_refuse_rows_they_do_not_compute_and_prefill_again(stored, tmp_path):
    root = _off_by_one_ulp(stored, "noisy-batch4", tmp_path)
    gen, cold = load(root, threads=1, batch=True), load(root, threads=1, config={"prefix_cache_bytes": 0})
    prompts = [
        gen.prepare_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}]).ids for t in TURNS
    ]
    got = gen.batch(prompts, max_new_tokens=10)
    assert [r.token_ids for r in got] == [cold.generate(p, max_new_tokens=10).token_ids for p in prompts]
    assert gen.prefix_cache.describe()["system_prompt"]["refused"]


def test_build_stores_the_system_prompt_with_the_option(tiny_artifacts, tmp_path):
    """`specexport build --system-prompt FILE` end to end: the files are listed with their sha256
    (so a signature over the manifest covers them) and the recipe key is recorded."""
    from specexport.cli.main import cli

    recipe = tiny_artifacts["ngram"].parent / "recipe.yaml"
    prompt = tmp_path / "system.txt"
    prompt.write_text(SYSTEM, encoding="utf-8")
    out = tmp_path / "built"
    result = CliRunner().invoke(
        cli, ["build", str(recipe), "-o", str(out), "--no-validate", "--quiet", "--system-prompt", str(prompt)]
    )
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    entry = manifest.system_prompt
    assert set(entry.rows) == {"target"} and {entry.ids, entry.text, *entry.rows.values()} <= set(manifest.files)
    assert json.loads((out / "recipe.json").read_text())["system_prompt"] == str(prompt)
    assert not list(tmp_path.glob(".built.*"))  # no temporary folder left
    warm, cold = load(out, threads=1), load(out, threads=1, config={"prefix_cache_bytes": 0})
    got, want = chat(warm, {}), chat(cold, {})
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want] and got[0][2] >= entry.tokens - 1


def test_a_bad_system_prompt_file_is_refused_in_one_line(tmp_path):
    from specexport.build.prompt import read_system_prompt
    from specexport.errors import BuildError

    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe")
    for path, what in ((empty, "is empty"), (binary, "is not UTF-8"), (tmp_path / "none.txt", "does not exist")):
        with pytest.raises(BuildError, match=what) as exc:
            read_system_prompt(path)
        assert "\n" not in str(exc.value)


def test_a_later_request_restores_the_parts_an_earlier_one_did_not_use(stored):
    """Target-only first (the target's rows from the file), then the draft proposer: the target's
    rows come from the pool, its draft rows from the file, and both answers equal a cold prefill's."""
    root = stored("noisy")
    warm, cold = load(root, threads=1), load(root, threads=1, config={"prefix_cache_bytes": 0})
    for settings in ({"proposer": "none"}, {"proposer": "draft"}):
        got, want = chat(warm, settings, TURNS[:1]), chat(cold, settings, TURNS[:1])
        assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want] and got[0][2] > 0
    assert warm.prefix_cache.describe()["system_prompt"]["restored"] == {"target": 1, "draft": 1}


def test_the_servers_first_request_reports_the_stored_prompt_as_cached(stored):
    """Through the HTTP server: each API key's first request with the system prompt restores the
    stored rows (usage.prompt_tokens_details.cached_tokens) and answers as a cold generator."""
    pytest.importorskip("starlette")
    from test_server_support import CHAT, LiveServer, post

    root = stored("noisy-fused")
    n = read_manifest(root).system_prompt.tokens
    cold = load(root, threads=1, config={"prefix_cache_bytes": 0})
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    want = cold.chat(messages, max_new_tokens=8).text
    server = LiveServer(load(root, threads=1))
    try:
        for key in ("alice", "bob"):  # one namespace each: seeded into both
            body = {"model": server.state.model, "messages": messages, "max_tokens": 8, "temperature": 0}
            status, _, res = post(server.port, CHAT, body, key=key)
            assert status == 200, res
            assert res["usage"]["prompt_tokens_details"]["cached_tokens"] >= n - 1
            assert res["choices"][0]["message"]["content"] == want
    finally:
        server.close()


def test_batch_slots_take_the_stored_prompt_and_equal_solo_cold_starts(stored):
    """The batch graph's slots: the check recomputes the stored rows with the slots graph, and each
    sequence answers as a solo generator without a pool."""
    root = stored("noisy-batch4")
    gen, cold = load(root, threads=1, batch=True), load(root, threads=1, config={"prefix_cache_bytes": 0})
    prompts = [
        gen.prepare_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}]).ids for t in TURNS
    ]
    got = gen.batch(prompts, max_new_tokens=10)
    assert [r.token_ids for r in got] == [cold.generate(p, max_new_tokens=10).token_ids for p in prompts]
    assert all(r.stats.cached_tokens > 0 for r in got) and gen.prefix_cache.describe()["system_prompt"]["checked"]


def test_evicted_or_cleared_rows_are_read_again_and_a_small_bound_stays_exact(stored):
    root = stored("noisy")
    n = read_manifest(root).system_prompt.tokens
    warm, cold = load(root, threads=1), load(root, threads=1, config={"prefix_cache_bytes": 0})
    want = chat(cold, {}, TURNS[:1])
    assert chat(warm, {}, TURNS[:1])[0][0] == want[0][0]
    warm.prefix_cache.pool.clear()
    got = chat(warm, {}, TURNS[:1])
    assert got[0][0] == want[0][0] and got[0][2] >= n - 1
    assert warm.prefix_cache.describe()["system_prompt"]["restored"]["target"] == 2
    # a bound smaller than the stored rows: they go into the model's cache, not through the pool
    tiny = load(root, threads=1, config={"prefix_cache_bytes": 1024})
    got = chat(tiny, {}, TURNS[:1])
    assert got[0][0] == want[0][0] and got[0][2] >= n - 1 and tiny.prefix_cache.describe()["bytes"] <= 1024


def test_a_signed_artifact_covers_the_stored_prompt(stored, tmp_path):
    """The signature covers the stored rows through the manifest's checksums: a signed artifact
    loads with its key and restores them; a changed row file is refused on first use."""
    pytest.importorskip("cryptography")
    from specexport_runtime.signing import keygen, sign

    root = tmp_path / "artifact"
    shutil.copytree(stored("noisy"), root)
    private, public = keygen(tmp_path / "keys")
    sign(root, private)
    gen = load(root, threads=1, trusted_keys=[public])
    assert chat(gen, {}, TURNS[:1])[0][2] > 0
    rows = root / "system_prompt" / "target.npy"
    data = bytearray(rows.read_bytes())
    data[-1] ^= 1
    rows.write_bytes(bytes(data))
    gen = load(root, threads=1, trusted_keys=[public])  # the manifest and its signature are unchanged
    with pytest.raises(ChecksumError, match="system_prompt/target.npy"):
        chat(gen, {}, TURNS[:1])


def test_a_failing_system_prompt_stage_leaves_nothing(tiny_artifacts, tmp_path, monkeypatch):
    """The stage runs in the build's temporary folder: a failure there leaves no output and no
    temporary folder; a system prompt longer than the context is refused in one line."""
    from specexport.build import prompt as build_prompt
    from specexport.build.artifact import build_artifact
    from specexport.errors import BuildError
    from specexport.recipe.load import load_recipe

    recipe = load_recipe(tiny_artifacts["ngram"].parent / "recipe.yaml")
    long = tmp_path / "long.txt"
    long.write_text("word " * 2000, encoding="utf-8")  # far more than the tiny context of 256 ids
    with pytest.raises(BuildError, match=r"renders to \d+ ids before the first user message; expected 2 to") as exc:
        build_artifact(with_overrides(recipe, {"system_prompt": str(long)}), tmp_path / "out", validate=False)
    assert "\n" not in str(exc.value)
    prompt = tmp_path / "system.txt"
    prompt.write_text(SYSTEM, encoding="utf-8")

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(build_prompt, "prompt_ids", boom)
    with pytest.raises(RuntimeError, match="injected"):
        build_artifact(with_overrides(recipe, {"system_prompt": str(prompt)}), tmp_path / "out", validate=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.txt", "system.txt"]


def test_a_user_message_merged_into_the_last_stored_id_checks_the_row_before(stored):
    """The chat template may merge the first user message into the last stored id: the request
    then restores the rows before it, its prefill recomputes the row before that as the check,
    and the answer equals a cold prefill's."""
    root = stored("noisy-fused")
    warm, cold = load(root, threads=1), load(root, threads=1, config={"prefix_cache_bytes": 0})
    ids = [int(i) for i in np.load(root / "system_prompt" / "ids.npy")]
    n = len(ids)
    other = next(t for t in range(5, 50) if t != ids[-1])
    prompt = ids[:-1] + [other] + ids[-6:-1]
    got = warm.generate(prompt, max_new_tokens=10, logprobs=0)
    want = cold.generate(prompt, max_new_tokens=10, logprobs=0)
    assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
    assert got.stats.cached_tokens == n - 2
    assert warm.prefix_cache.describe()["system_prompt"]["checked"]


def test_the_first_token_leaves_before_the_draft_rows_are_restored(stored):
    """The draft's rows are not needed for the first token: its event comes before they are read
    from the artifact, and the rest of the answer equals a cold prefill's."""
    root = stored("noisy")
    warm, cold = load(root, threads=1), load(root, threads=1, config={"prefix_cache_bytes": 0})
    prompt = warm.prepare_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]).ids
    run = warm.events(prompt, max_new_tokens=12, proposer="draft")
    first = next(run)
    assert first[0] and warm.prefix_cache.describe()["system_prompt"]["restored"] == {"target": 1}
    tokens = list(first[0]) + [t for new, _, _ in run for t in new]
    assert warm.prefix_cache.describe()["system_prompt"]["restored"] == {"target": 1, "draft": 1}
    assert tokens == cold.generate(prompt, max_new_tokens=12, proposer="draft").token_ids


def test_a_hybrid_target_refuses_a_stored_system_prompt_before_weights_load(tmp_path):
    from tiny import make_model, save_hf_folder, write_recipe

    from specexport.build.artifact import build_artifact
    from specexport.models.config import UnsupportedConfig
    from specexport.recipe.load import load_recipe

    folder = save_hf_folder(make_model("lfm2"), tmp_path / "hf")  # convolution and attention layers
    prompt = tmp_path / "system.txt"
    prompt.write_text(SYSTEM, encoding="utf-8")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", folder, {"proposer": "ngram"}, graph="fused"))
    with pytest.raises(UnsupportedConfig, match="recurrent layers.*build without a stored system prompt") as info:
        build_artifact(with_overrides(recipe, {"system_prompt": str(prompt)}), tmp_path / "out")
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
