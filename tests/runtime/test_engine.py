"""OrtModel: cursor semantics, in-place KV writes, buffers allocated once, bounds, memory."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from specexport_runtime.engine import OrtModel, SessionConfig
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.manifest import read_manifest

IDS = [17, 88, 203, 5, 61, 144, 9, 250, 33, 71, 120, 8, 199, 42, 66, 3, 275, 100, 12, 47]
ALT = [230, 14, 77, 191, 58]


@pytest.fixture(scope="module", params=["noisy", "noisy-fused"], ids=["time_major", "head_major_inplace"])
def target(tiny_artifacts, request):
    """(graph path, GraphSpec, max_context, cache_pad) of the tiny fp32 target, in each contract
    layout (the fused one pads its attention: contract 1.2)."""
    root = tiny_artifacts[request.param]
    m = read_manifest(root)
    return root / m.target.graph, m.target.graph_spec(), m.max_context, m.target.cache_pad


def new_model(target) -> OrtModel:
    path, spec, max_context, cache_pad = target
    return OrtModel(path, spec, max_context, SessionConfig(), cache_pad=cache_pad)


@pytest.fixture(scope="module")
def feed_runner(target):
    """The build side's validation runner (growing numpy cache, plain session.run feeds)."""
    from specexport.build.validate import FeedRunner

    path, spec, _, _ = target

    def make():
        return FeedRunner(path, spec)

    return make


def test_truncate_then_forward_matches_fresh_run(target):
    model = new_model(target)
    model.forward(IDS[:10])
    verify = model.forward(IDS[10:15], last_rows=5).copy()  # [5, V]: a 4-token verify call
    assert verify.shape == (5, target[1].embedding_rows)
    assert model.length == 15
    model.truncate(12)  # keep IDS[:12]: rows 12..14 are rejected
    assert model.length == 12
    got = model.forward(ALT[:3], last_rows=3).copy()
    fresh = new_model(target)
    expected = fresh.forward(IDS[:12] + ALT[:3], last_rows=3).copy()
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    # the rows before the truncation point are the verify rows of a fresh run too
    fresh.truncate(10)
    np.testing.assert_allclose(verify[:2], fresh.forward(IDS[10:12], last_rows=2), atol=1e-5, rtol=0)
    # and the same holds for a single-token decode after a rollback
    model.truncate(5)
    one = model.forward([ALT[4]]).copy()
    fresh.reset()
    np.testing.assert_allclose(one, fresh.forward(IDS[:5] + [ALT[4]]), atol=1e-5, rtol=0)


def ref_rows(ref, spec) -> list[np.ndarray]:
    """The reference runner's caches as [P, H_kv, D] (its layout follows the graph's)."""
    return [c[0].transpose(1, 0, 2) if spec.layout.in_place else c[0] for c in ref.cache]


def test_rows_written_in_place_at_cursor(target, feed_runner):
    """After each call the buffer rows [0, P+S) equal the K/V the reference runner accumulates;
    rows past the cursor and its padding row (a padded-attention graph writes row P+S) are
    never written (fresh buffers: still zero), and after a rollback the stale rows past the new
    write are left as they were (nothing is cleared)."""
    model, ref = new_model(target), feed_runner()
    spec, pad = target[1], target[3]
    assert len(model._buffers) == 2 * spec.num_layers
    steps = [(IDS[:7], 1), (IDS[7:8], 1), (IDS[8:13], 5)]
    for ids, rows in steps:
        got = model.forward(ids, last_rows=rows).copy()
        want = ref.run(ids, list(range(len(ids) - rows, len(ids))))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        n = model.length
        assert n == ref.past_len
        for rows, cache, rest in zip(
            model.kv_rows(0, n), ref_rows(ref, spec), model.kv_rows(n + pad, model.max_context)
        ):
            np.testing.assert_allclose(rows, cache, atol=1e-5, rtol=0)
            assert not rest.any()
    stale = [r.copy() for r in model.kv_rows(10 + pad, 13)]  # rows of IDS[10 + pad:13]
    model.truncate(9)
    ref.rollback(4)
    model.forward(ALT[:1])  # writes row 9 (and row 10 with padded attention) only
    ref.run(ALT[:1], [0])
    for rows, cache, new_stale, old in zip(
        model.kv_rows(0, 10), ref_rows(ref, spec), model.kv_rows(10 + pad, 13), stale
    ):
        np.testing.assert_allclose(rows, cache, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(new_stale, old)  # untouched, unread


def test_past_length_zero(target, feed_runner):
    model = new_model(target)
    assert model.length == 0
    got = model.forward(IDS[:1]).copy()  # P = 0, S = 1
    np.testing.assert_allclose(got, feed_runner().run(IDS[:1], [0]), atol=1e-5, rtol=0)
    model.reset()
    rows = model.forward(IDS[:6], last_rows=6).copy()  # P = 0, all rows returned
    np.testing.assert_allclose(rows, feed_runner().run(IDS[:6], list(range(6))), atol=1e-5, rtol=0)
    np.testing.assert_allclose(rows[0], got[0], atol=1e-5, rtol=0)


def test_buffers_allocated_once(target):
    model = new_model(target)
    buffers = list(model._buffers)
    ptrs = [b.ctypes.data for b in buffers]
    logits_ptr = model._logits.ctypes.data
    assert ptrs == model._ptrs
    rng = np.random.default_rng(0)
    for _ in range(50):
        if model.length > 200:
            model.truncate(int(rng.integers(0, 20)))
        s = int(rng.integers(1, 6))
        out = model.forward(rng.integers(0, 300, size=s).tolist(), last_rows=int(rng.integers(1, s + 1)))
        assert np.shares_memory(out, model._logits)  # logits land in the preallocated host buffer
    assert all(a is b for a, b in zip(model._buffers, buffers)) and len(model._buffers) == len(buffers)
    assert [b.ctypes.data for b in model._buffers] == ptrs == model._ptrs
    assert model._logits.ctypes.data == logits_ptr
    assert model.stats.calls == 50


def test_bounds(target):
    model = new_model(target)
    max_context = target[2]
    with pytest.raises(InvalidArgument, match=str(max_context)):
        model.forward([5] * (max_context + 1))
    assert model.length == 0
    model.forward([5] * (max_context - 2))
    with pytest.raises(
        InvalidArgument, match=f"{max_context - 2} cached \\+ 3 new tokens exceed max_context {max_context}"
    ):
        model.forward([5, 6, 7])
    assert model.length == max_context - 2  # a refused call leaves the cursor alone
    model.forward([5, 6])  # exactly full is fine
    assert model.length == max_context and model.free == 0
    with pytest.raises(InvalidArgument):
        model.forward([5])
    with pytest.raises(InvalidArgument, match="S >= 1"):
        model.forward([])
    model.reset()
    with pytest.raises(InvalidArgument, match="rows=3"):
        model.forward([5, 6], last_rows=3)
    with pytest.raises(InvalidArgument, match="rows=0"):
        model.forward([5, 6], last_rows=0)
    model.forward([5, 6])
    for bad in (-1, 3):
        with pytest.raises(InvalidArgument, match=f"to {bad}"):
            model.truncate(bad)
    assert model.length == 2


def test_resident_memory_flat(target):
    """300 single-token steps after a warm-up over the whole cursor range: RSS grows < 2 MB."""
    psutil = pytest.importorskip("psutil")
    model = new_model(target)
    proc = psutil.Process()
    prompt = IDS[:10]

    def steps(n):
        for i in range(n):
            if model.length >= 250:
                model.truncate(len(prompt))
            model.forward([IDS[i % len(IDS)]])

    model.forward(prompt)
    steps(2 * 240)  # warm-up: every past length 10..250 seen (arena and shape caches settle)
    gc.collect()
    before = proc.memory_info().rss
    steps(300)
    gc.collect()
    growth = proc.memory_info().rss - before
    assert growth < 2 * 1024 * 1024, f"RSS grew by {growth / 1e6:.2f} MB over 300 steps"


def test_prepack_off_gives_the_same_logits(tiny_artifacts):
    """load(..., prepack=False) turns ONNX Runtime's weight repacking off in every session it
    makes (the session option is set) and decodes the same greedy tokens as the default."""
    from specexport_runtime.api import load

    art = tiny_artifacts["self"]
    mapped, repacked = load(art, prepack=False), load(art)
    for model in (mapped.target, mapped.draft):
        options = model.session.get_session_options()
        assert options.get_session_config_entry("session.disable_prepacking") == "1"
    with pytest.raises(RuntimeError, match="disable_prepacking"):  # the default leaves it unset
        repacked.target.session.get_session_options().get_session_config_entry("session.disable_prepacking")
    a = mapped.generate(IDS, max_new_tokens=12, speculative=False).token_ids
    assert a == repacked.generate(IDS, max_new_tokens=12, speculative=False).token_ids and len(a) > 0


def test_generate_cli_passes_no_prepack_to_load(tiny_artifacts, monkeypatch, capsys):
    """`specexport-runtime generate --no-prepack` loads with prepack=False; without it, True."""
    from specexport_runtime import api, cli

    seen = []
    real = api.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("prepack"))
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "load", spy)  # the CLI imports it from api when it runs
    art = str(tiny_artifacts["self"])
    for extra in (["--no-prepack"], []):
        assert cli.main(["generate", art, "--prompt", "hello", "--max-new-tokens", "4", *extra]) == 0
    assert seen == [False, True]
