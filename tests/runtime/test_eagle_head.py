"""An EAGLE-3 head and its target's features through the runtime (OrtModel), in both contract
layouts: the tiny artifacts 'eagle3' (fused: head_major_inplace) and 'eagle3-portable'
(time_major). Checked against independent references: transformers' output_hidden_states for the
target's features and tests/eagle_heads.py's reference forward for the head's logits, hidden rows
and the K rows it leaves in its cache; plus the cursor (reset / truncate / free) semantics the
eagle proposer relies on. Tolerance: 1e-4 absolute (float32 graphs against float32 PyTorch)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from eagle_heads import reference_fc, reference_step, target_features
from safetensors.torch import load_file
from tiny import make_model

from specexport_runtime.engine import OrtModel, SessionConfig
from specexport_runtime.manifest import read_manifest

TOL = 1e-4
IDS = [17, 88, 203, 5, 61, 144, 9, 250, 33, 71, 120, 8, 199, 42, 66, 3]


@pytest.fixture(scope="module", params=["eagle3", "eagle3-portable"], ids=["fused", "portable"])
def artifact(tiny_artifacts, request):
    """(artifact root, manifest, the head's published tensors, its config dict, target model)."""
    root = tiny_artifacts[request.param]
    folder = root.parent / "head"  # tiny.build_tiny_artifact writes the head beside the artifact
    stored = load_file(str(folder / "model.safetensors"))
    tensors = {k: (v.float() if v.is_floating_point() else v) for k, v in stored.items()}
    cfg = json.loads((folder / "config.json").read_text())
    return root, read_manifest(root), tensors, cfg, make_model("llama")  # the artifact's target (seed 0)


def _models(root, manifest) -> tuple[OrtModel, OrtModel]:
    t, d = manifest.target, manifest.draft
    target = OrtModel(
        root / t.graph,
        t.graph_spec(),
        manifest.max_context,
        SessionConfig(threads=1),
        min_rows=t.min_rows,
        cache_pad=t.cache_pad,
    )
    head = OrtModel(root / d.graph, d.graph_spec(), manifest.max_context, SessionConfig(threads=1))
    return target, head


def test_target_features_through_the_runtime(artifact):
    """The runtime's feature rows of a prompt, then of a 3-token verify-like call, equal
    transformers' output_hidden_states at the manifest's feature layers."""
    root, manifest, _, _, model = artifact
    target, _ = _models(root, manifest)
    target.forward(IDS[:12])
    first = target.features.copy()
    target.forward(IDS[12:15], last_rows=3)
    assert target.last_start == 12
    got = np.concatenate([first, target.features])  # [15, F]
    want = target_features(model, IDS[:15], manifest.target.feature_layers).numpy()
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_head_cursor_cache_and_rows_match_the_reference(artifact):
    """Catch-up, chain, truncate, chain again, reset: logits, hidden_out and the head's K cache rows
    equal the reference forward's, and free / length follow the cursor."""
    root, manifest, tensors, cfg, model = artifact
    _, head = _models(root, manifest)
    embed = model.get_input_embeddings().weight.detach().float()
    feats = target_features(model, IDS, manifest.target.feature_layers)  # [S, F]
    n = 8
    got = head.forward(IDS[1 : n + 1], last_rows=n, features=feats[:n].numpy()).copy()
    want, hidden, past = reference_step(tensors, cfg, embed, IDS[1 : n + 1], reference_fc(tensors, feats[:n]), None, 0)
    np.testing.assert_allclose(got, want.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(head.hidden_out, hidden.numpy(), atol=TOL, rtol=0)
    k_rows = head.kv_rows(0, n)[0]  # [n, H_kv, D] whatever the layout
    np.testing.assert_allclose(k_rows, past[0].transpose(0, 1).numpy(), atol=TOL, rtol=0)
    assert head.length == n and head.free == manifest.max_context - n

    def chain(token: int) -> tuple[np.ndarray, np.ndarray]:
        logits = head.forward([token], hidden=hidden[-1:].numpy()).copy()
        return logits, head.hidden_out.copy()

    first = chain(101)
    want1, h1, _ = reference_step(tensors, cfg, embed, [101], hidden[-1:], past, n)
    np.testing.assert_allclose(first[0], want1.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(first[1], h1.numpy(), atol=TOL, rtol=0)
    chain(7)
    assert head.length == n + 2
    head.truncate(n)  # drop the chain rows: the next chain step is the first one again
    again = chain(101)
    np.testing.assert_array_equal(again[0], first[0])
    np.testing.assert_array_equal(again[1], first[1])
    head.reset()
    assert head.length == 0 and head.free == manifest.max_context
    fresh = head.forward(IDS[1 : n + 1], last_rows=n, features=feats[:n].numpy())
    np.testing.assert_array_equal(fresh, got)


def test_head_rejects_rows_of_the_wrong_width(artifact):
    from specexport_runtime.errors import InvalidArgument

    root, manifest, _, _, _ = artifact
    _, head = _models(root, manifest)
    with pytest.raises(InvalidArgument, match="features must hold 2 rows of"):
        head.forward([5, 6], features=np.zeros((2, 7), np.float32))


def test_eagle_proposer_keeps_the_targets_features(artifact):
    """commit() stores the features the target's last call computed for committed positions (a
    prompt call, then a verify call of 4 rows of which 2 are accepted): they equal transformers'
    output_hidden_states, and the head is truncated to the rows it computed from features."""
    from specexport_runtime.eagle import EagleProposer

    root, manifest, _, _, model = artifact
    target, head = _models(root, manifest)
    d2t = np.load(root / manifest.draft.vocab_map)
    eagle = EagleProposer(head, target, d2t, manifest.target.embedding_rows)
    eagle.start(IDS[:6])
    target.forward(IDS[:5])  # the target caches committed[:-1]
    eagle.commit(IDS[:6], 6)
    assert eagle.known == 5
    target.forward(IDS[5:9], last_rows=4)  # verify: committed[-1] + 3 drafts, 2 accepted + 1 correction
    target.truncate(7)
    eagle.commit(IDS[:8], 2)
    assert eagle.known == 7
    want = target_features(model, IDS[:7], manifest.target.feature_layers).numpy()
    np.testing.assert_allclose(eagle.features[:7], want, atol=TOL, rtol=0)
