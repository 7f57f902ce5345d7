"""Row padding (contract 1.2): plan_rows, OrtModel with padded calls (min_rows) and a padded
attention graph (cache_pad), row_invariance, and the manifest fields min_rows / cache_pad /
exactness."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from specexport.build.rowcheck import row_invariance
from specexport_runtime import contract
from specexport_runtime.engine import OrtModel, SessionConfig, plan_rows
from specexport_runtime.errors import ArtifactError, InvalidArgument
from specexport_runtime.manifest import read_manifest

# --------------------------------------------------------------------------- plan_rows (pure)


@pytest.mark.parametrize(
    "S, last_rows, min_rows, M, first, count, keep",
    [
        (1, 1, 1, 1, 0, 1, (0, 1)),  # the plain call
        (5, 5, 1, 5, 0, 5, (0, 5)),
        (5, 1, 1, 5, 4, 1, (0, 1)),
        (1, 1, 2, 2, 0, 2, (0, 1)),  # a decode step: one padding row, two logits rows
        (1, 1, 4, 4, 0, 4, (0, 1)),
        (3, 1, 2, 3, 1, 2, (1, 2)),  # a prefill asking one row still asks two: rows 1, 2
        (3, 3, 2, 3, 0, 3, (0, 3)),  # a verify call needs no padding
        (2, 2, 4, 4, 0, 4, (0, 2)),
        (3, 2, 4, 4, 0, 4, (1, 3)),
    ],
)
def test_plan_rows(S, last_rows, min_rows, M, first, count, keep):
    ids = np.arange(10, 10 + S, dtype=np.int64)[None]
    call = plan_rows(ids, last_rows, min_rows)
    assert call.ids.shape == (1, M)
    assert call.ids[0, :S].tolist() == ids[0].tolist()
    assert set(call.ids[0, S:].tolist()) <= {int(ids[0, -1])}  # padding repeats the last real token
    assert (call.first, call.count) == (first, count)
    assert (call.keep.start, call.keep.stop) == keep
    asked = list(range(call.first, call.first + call.count))
    assert asked[call.keep] == list(range(S - last_rows, S))  # the caller's rows, in order
    assert call.first + call.count <= M


# --------------------------------------------------------------------------- OrtModel with min_rows


def _model(artifact, min_rows: int, cache_pad: int | None = None) -> OrtModel:
    manifest = read_manifest(artifact)
    pad = manifest.target.cache_pad if cache_pad is None else cache_pad
    return OrtModel(
        artifact / manifest.target.graph,
        manifest.target.graph_spec(),
        manifest.max_context,
        SessionConfig(threads=1),
        min_rows=min_rows,
        cache_pad=pad,
    )


@pytest.mark.parametrize("kind", ["ngram", "ngram-fused"])
def test_padded_calls_match_plain_calls(tiny_artifacts, kind):
    """The same tokens fed one per call, padded or not, give the same logits (to float noise)
    and leave the cursor at the real length; the padding row's K/V is never read."""
    artifact = tiny_artifacts[kind]
    plain, padded = _model(artifact, 1), _model(artifact, 2)
    prompt, tokens = [5, 9, 14, 3, 22, 7], [40, 41, 42, 43, 44, 45, 46]
    rows = {}
    for name, model in (("plain", plain), ("padded", padded)):
        first = model.forward(prompt)[0].copy()
        steps = [model.forward([t])[0].copy() for t in tokens]
        assert model.length == len(prompt) + len(tokens)
        rows[name] = np.stack([first] + steps)
    np.testing.assert_allclose(rows["padded"], rows["plain"], rtol=0, atol=1e-4)
    assert (rows["padded"].argmax(-1) == rows["plain"].argmax(-1)).all()


@pytest.mark.parametrize("kind", ["int4-target", "ngram"])
def test_padded_model_reaches_the_last_position(tiny_artifacts, kind):
    """The padding row of the last position lies past max_context: the cache (and a fused
    graph's rotary tables, built with max_context + 1 rows) hold it, whether the graph pads its
    attention (the fused int4 target: cache_pad 1) or the runtime pads calls (the portable fp32
    target, whose 1-row calls measured numerical: min_rows 2)."""
    artifact = tiny_artifacts[kind]
    entry = read_manifest(artifact).target
    # int4-target: padded attention, or padded calls where this CPU's 1-row attention path differs
    assert (entry.min_rows, entry.cache_pad) in ([(1, 1), (2, 0)] if kind == "int4-target" else [(2, 0)])
    model = _model(artifact, entry.min_rows)
    max_context = model.max_context
    assert model.cache_rows == max_context + 1
    model.forward(list(range(3, 3 + max_context - 1)))
    out = model.forward([7])  # position max_context - 1; its padding row sits at max_context
    assert np.isfinite(out).all() and model.length == max_context
    with pytest.raises(InvalidArgument, match="exceed max_context"):
        model.forward([7])


def test_min_rows_out_of_range(tiny_artifacts):
    with pytest.raises(InvalidArgument, match="min_rows"):
        _model(tiny_artifacts["ngram"], 0)


# --------------------------------------------------------------------------- row_invariance


class _FakeModel:
    """Logits that are a fixed function of the token, plus `call_noise` times the number of
    rows of the call: row-invariant exactly when call_noise == 0."""

    def __init__(self, call_noise: float, min_rows: int = 1):
        self.call_noise, self.min_rows, self.length = call_noise, min_rows, 0

    def reset(self) -> None:
        self.length = 0

    def forward(self, ids, last_rows: int = 1) -> np.ndarray:
        ids = list(ids)
        self.length += len(ids)
        rows = np.array([[np.sin(t * (v + 1)) for v in range(8)] for t in ids], np.float32)
        rows += np.float32(self.call_noise * max(len(ids), self.min_rows))
        return rows[len(ids) - last_rows :]


def test_row_invariance_detects_call_dependent_rows():
    report = row_invariance(_FakeModel(1e-3), [1, 2, 3], list(range(4, 30)))
    assert not report.bitwise and report.exactness == "numerical"
    assert report.max_abs_diff == pytest.approx(1e-3 * 16, rel=1e-3)  # a 17-row call vs 1-row calls
    assert report.rows == 2 + 3 + 5 + 9 + 17


def test_row_invariance_accepts_invariant_rows():
    report = row_invariance(_FakeModel(0.0), [1, 2, 3], list(range(4, 30)))
    assert report.bitwise and report.max_abs_diff == 0.0 and report.argmax_agreement == 1.0
    assert report.to_dict()["exactness"] == "bitwise"


def test_row_invariance_needs_tokens():
    with pytest.raises(ValueError, match="tokens"):
        row_invariance(_FakeModel(0.0), [1], [2])


@pytest.mark.parametrize("min_rows", [1, 2])
def test_padded_tiny_target_is_bitwise(tiny_artifacts, min_rows):
    """The tiny int4 target built with exactness bitwise: rows measure bitwise equal with the
    calls its padding allows (1-row calls under padded attention), and with padded calls on top."""
    artifact = tiny_artifacts["int4-target"]
    model = _model(artifact, max(min_rows, read_manifest(artifact).target.min_rows))
    report = row_invariance(model, [5, 9, 14, 3], list(range(20, 40)))
    assert report.bitwise, report


# --------------------------------------------------------------------------- manifest fields


def _edit(artifact, tmp_path, **target_fields):
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["target"].update(target_fields)
    (copy / "manifest.json").write_text(json.dumps(data))
    return copy


def test_manifest_records_exactness_and_padding(tiny_artifacts):
    raw = json.loads((tiny_artifacts["int4-target"] / "manifest.json").read_text())
    assert raw["contract_version"] == "1.2"
    padding = (raw["target"]["min_rows"], raw["target"]["cache_pad"])
    assert padding in [(1, 1), (2, 0)] and raw["target"]["exactness"] == "bitwise"  # the cheapest that measured bitwise
    rows = raw["target"]["validation"]["rows"]
    assert rows["bitwise"] is True
    assert rows["padding"] == ("padded attention" if padding == (1, 1) else "padded calls")


def test_unpadded_entries_keep_their_older_contract(tiny_artifacts):
    """A target without row padding keeps its 1.0 / 1.1 contract and writes neither 1.2 key,
    so a 1.1 runtime reads it; its measured exactness is read back from validation.rows."""
    raw = json.loads((tiny_artifacts["ngram-numerical"] / "manifest.json").read_text())
    assert raw["contract_version"] == "1.0"
    assert not {"min_rows", "cache_pad", "exactness"} & set(raw["target"])
    manifest = read_manifest(tiny_artifacts["ngram-numerical"])
    assert manifest.target.exactness == raw["target"]["validation"]["rows"]["exactness"]
    assert manifest.target.required_version == contract.version_for(manifest.target.kv_layout) == "1.0"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"min_rows": 0}, "min_rows: 0 is not an integer in 1..16"),  # the schema check (schema.py) names them
        ({"min_rows": "2"}, "min_rows: '2' is not an integer"),
        ({"cache_pad": -1}, "cache_pad: -1 is not an integer"),
        ({"exactness": "exact"}, "exactness: 'exact' is not one of bitwise, numerical"),
    ],
)
def test_bad_fields_are_typed_errors(tiny_artifacts, tmp_path, fields, message):
    copy = _edit(tiny_artifacts["int4-target"], tmp_path, **fields)
    with pytest.raises(ArtifactError, match=message):
        read_manifest(copy)


def test_padding_needs_contract_1_2(tiny_artifacts, tmp_path):
    copy = _edit(tiny_artifacts["int4-target"], tmp_path)
    data = json.loads((copy / "manifest.json").read_text())
    data["contract_version"] = "1.1"
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="needs contract 1.2"):
        read_manifest(copy)
