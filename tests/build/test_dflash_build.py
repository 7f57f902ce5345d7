"""DFlash block drafters (feature dflash_block): the drafter folder read and checked against the
target before anything is written, and the drafter graph against transformers' own forward of the
same random-init drafter (the layout its DFlash generator reads) for the same target hidden states.

Tolerance: float32 graph against float32 PyTorch with the same weights: 1e-4 absolute on logits
(summation order only), and the same argmax on every drafted row."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from dflash_support import BLOCK, LAYER_IDS, MASK, ReferenceDrafter, hidden_context, tiny_drafter, tiny_target

from specexport.graphs.dflash import build_dflash_graph
from specexport.models.config import UnsupportedConfig
from specexport.models.dflash import is_dflash_folder, load_dflash, read_dflash_config
from specexport_runtime import contract

TOL = 1e-4
IDS = [1, 5, 9, 33, 100, 7, 8, 2, 44, 61, 17, 250, 3, 90]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    target = tiny_target()
    reference = tiny_drafter(root / "drafter")
    return target, reference, root / "drafter"


def _edit(folder, tmp_path, **changes):
    """A copy of the drafter folder with config.json keys changed (None: removed)."""
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# --------------------------------------------------------------------------- the folder


def test_drafter_folder_is_recognised_and_read(pair, tmp_path):
    target, _, folder = pair
    assert is_dflash_folder(folder)
    assert not is_dflash_folder(tmp_path)
    drafter = load_dflash(folder, target.config)
    c = drafter.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (BLOCK, MASK, LAYER_IDS)
    assert c.feature_layers == (1, 3) and c.feature_width == 2 * 64 and c.layout == "transformers"


def test_published_layout_reads_the_same_weights(pair, tmp_path):
    """dflash_config keys and fc / hidden_norm names (the published checkpoints') map onto the same drafter."""
    from safetensors.torch import load_file, save_file

    target, _, folder = pair
    out = tmp_path / "published"
    out.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    inner = {k: cfg.pop(k) for k in ("mask_token_id", "target_layer_ids")}
    cfg["dflash_config"] = inner
    (out / "config.json").write_text(json.dumps(cfg))
    names = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({names.get(k, k): v for k, v in tensors.items()}, str(out / "model.safetensors"))
    a, b = load_dflash(folder, target.config), load_dflash(out, target.config)
    assert b.config.layout == "published" and b.config.target_layer_ids == a.config.target_layer_ids
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"target_layer_ids": [0, 3]}, r"target_layer_ids \[3\] are outside the target's 0..2"),
        ({"target_layer_ids": [-1]}, r"target_layer_ids \[-1\] are outside"),
        ({"mask_token_id": 320}, r"mask_token_id 320 is outside the target's 320 embedding rows"),
        ({"block_size": 1}, r"block_size must be >= 2"),
        ({"hidden_size": 96}, r"hidden_size 96 differs from the target's 64"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not implemented"),
        ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 8}, r"sliding-window layers \(window 8\)"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type 'yarn' is not implemented"),
    ],
)
def test_drafter_that_does_not_fit_is_refused_in_one_line(pair, tmp_path, changes, message):
    target, _, folder = pair
    with pytest.raises(UnsupportedConfig, match=message) as err:
        load_dflash(_edit(folder, tmp_path, **changes), target.config)
    assert "\n" not in str(err.value)


def test_drafter_weights_of_another_version_are_refused(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    target, _, folder = pair
    out = _edit(folder, tmp_path)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["layers.0.attention_conv.base_kernel"] = torch.zeros(2, 2, 64)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(
        UnsupportedConfig, match=r"weights \['layers.0.attention_conv.base_kernel'\] are not implemented"
    ):
        load_dflash(out, target.config)
    assert read_dflash_config(out).block_size == BLOCK  # the config alone is fine


# --------------------------------------------------------------------------- the graph


@pytest.fixture(scope="module")
def graph(pair, tmp_path_factory):
    target, _, folder = pair
    drafter = load_dflash(folder, target.config)
    embed = target.get_input_embeddings().weight.detach().float()
    return build_dflash_graph(drafter, embed, None, tmp_path_factory.mktemp("dflash-graph"))


def _run(session, spec, cache, context, block, rows):
    """One drafter call on a growing numpy cache; returns logits [R, V] and the new K/V rows."""
    feeds = {
        contract.INPUT_IDS: np.asarray([block], np.int64),
        contract.DFLASH_CONTEXT: np.ascontiguousarray(context, np.float32).reshape(1, -1, spec.feature_width),
        contract.LOGITS_INDEX: np.asarray(rows, np.int64),
    }
    for i in range(spec.num_layers):
        feeds[contract.past_key(i)], feeds[contract.past_value(i)] = cache[2 * i], cache[2 * i + 1]
    out = session.run(None, feeds)
    return out[0][0], out[1:]


def test_drafter_graph_drafts_the_same_block_as_transformers(pair, graph):
    """Three blocks in a row, as the generator calls them: the prompt's context, then 3 and 1
    accepted positions (the block's rows dropped from the cache each time), and a call with no new
    context (C = 0): logits within 1e-4, every drafted argmax equal."""
    from specexport_runtime.engine import SessionConfig, make_session

    target, reference, _ = pair
    ref = ReferenceDrafter(reference, target)
    spec = graph.spec
    assert spec.input_names()[:3] == ["input_ids", "context", "logits_index"]
    session = make_session(graph.path, SessionConfig(threads=1))
    context = hidden_context(target, IDS)  # [1, S, F]
    cache = [np.zeros((1, 0, spec.num_kv_heads, spec.head_dim), np.float32)] * (2 * spec.num_layers)
    P = 0
    for stop, anchor in ((8, IDS[8]), (11, IDS[11]), (12, IDS[12]), (12, 77)):
        ctx = context[:, P:stop]
        want = ref.block_logits(ctx, anchor).numpy()  # [B-1, V]
        got, new = _run(session, spec, cache, ctx.numpy(), [anchor] + [MASK] * (BLOCK - 1), list(range(1, BLOCK)))
        assert got.shape == want.shape == (BLOCK - 1, 320)
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
        assert (got.argmax(-1) == want.argmax(-1)).all()
        C = stop - P
        assert all(n.shape[1] == C + BLOCK for n in new)
        cache = [np.concatenate([c, n[:, :C]], axis=1) for c, n in zip(cache, new)]  # keep the context rows only
        P = stop


def test_drafter_graph_uses_standard_ops_and_declares_its_feature(graph):
    proto = onnx.load(str(graph.path), load_external_data=False)
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}
    assert [i.name for i in proto.graph.input] == graph.spec.input_names()
    assert [o.name for o in proto.graph.output] == graph.spec.output_names()
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta[contract.META_CONTRACT_VERSION] == contract.DFLASH_VERSION
    assert meta[contract.META_KV_LAYOUT] == contract.TIME_MAJOR
