"""EAGLE-3 head loader and writer (specexport/formats/eagle3.py) and the test-side reference
forward (tests/eagle_heads.py).

Head folders are written by tests/eagle_heads.py with plain json / safetensors code, then edited
here one defect at a time; each defect must give a one-line FormatError naming the value.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from eagle_heads import TINY_LAYER_IDS, make_tiny_head_folder, reference_fc, reference_step, target_features
from safetensors.torch import load_file, save_file
from tiny import make_model

from specexport.formats.blocks import FormatError
from specexport.formats.eagle3 import Eagle3Head, TargetShape, load_eagle3_head
from specexport.formats.eagle3_writer import ARCHITECTURE, write_eagle3_head

DRAFT_VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return make_model("llama")  # hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 320


@pytest.fixture(scope="module")
def shape(target) -> TargetShape:
    return TargetShape.from_hf_config(target.config)  # H_t 64, L 2, V_t 320


@pytest.fixture()
def head(tmp_path, target) -> dict:
    return make_tiny_head_folder(tmp_path / "head", target, DRAFT_VOCAB, seed=3)


def _edit(folder: Path, tensors=None, config=None) -> None:
    """Apply edits to a head folder: tensors / config are callables mutating the dicts."""
    if tensors is not None:
        data = load_file(folder / "model.safetensors")
        tensors(data)
        save_file({k: v.contiguous() for k, v in data.items()}, str(folder / "model.safetensors"))
    if config is not None:
        data = json.loads((folder / "config.json").read_text())
        config(data)
        (folder / "config.json").write_text(json.dumps(data))


def _error(folder: Path, shape: TargetShape, **kwargs) -> str:
    with pytest.raises(FormatError) as info:
        load_eagle3_head(folder, shape, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------------- loading


def test_load_gives_back_the_tensors(head, shape):
    loaded = load_eagle3_head(head["folder"], shape)
    for name, value in head["tensors"].items():
        if name in ("d2t", "t2d"):
            continue
        assert loaded.weights[name].dtype == torch.float32
        assert torch.equal(loaded.weights[name], value), name
    assert loaded.embed_tokens is None
    assert loaded.d2t.dtype == np.int64 and loaded.t2d.dtype == np.bool_
    np.testing.assert_array_equal(loaded.draft_to_target(), head["selected"].numpy())
    np.testing.assert_array_equal(np.flatnonzero(loaded.t2d), head["selected"].numpy())
    c = loaded.config
    heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert (c.hidden_size, c.target_hidden_size, heads) == (64, 64, (4, 2, 16))
    assert (c.intermediate_size, c.draft_vocab_size, c.vocab_size, c.hidden_act) == (128, DRAFT_VOCAB, 320, "silu")
    assert (c.rms_norm_eps, c.rope_theta, c.rope_scaling) == (1e-5, 10000.0, None)


def test_bf16_and_embed_tokens_load_as_float32(tmp_path, target, shape):
    made = make_tiny_head_folder(
        tmp_path / "bf16", target, DRAFT_VOCAB, seed=4, dtype=torch.bfloat16, embed_tokens=True
    )
    loaded = load_eagle3_head(made["folder"], shape)
    assert all(w.dtype == torch.float32 for w in loaded.weights.values())
    assert torch.equal(loaded.weights["fc.weight"], made["tensors"]["fc.weight"])  # bf16 values, exactly
    assert loaded.embed_tokens.shape == (320, 64)


def test_sharded_safetensors_with_index(head, shape):
    folder = head["folder"]
    data = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(data)
    shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    for file, part in shards.items():
        save_file({n: data[n] for n in part}, str(folder / file))
    index = {"weight_map": {n: file for file, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(load_eagle3_head(folder, shape).weights["lm_head.weight"], head["tensors"]["lm_head.weight"])


def test_layer_ids_from_config_are_output_of_layer_plus_one(head, shape):
    config = load_eagle3_head(head["folder"], shape).config
    assert json.loads((head["folder"] / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [0, -1, 0]
    assert config.layer_ids == TINY_LAYER_IDS == (1, 0, 1)
    assert config.layer_ids_source == "config"
    assert "[0, -1, 0]" in config.layer_ids_reason and "+1" in config.layer_ids_reason


def test_layer_ids_config_on_a_deep_target(tmp_path, target):
    deep = TargetShape(hidden_size=64, num_layers=32, vocab_size=320)
    made = make_tiny_head_folder(tmp_path / "h", target, DRAFT_VOCAB, seed=1, layer_ids=(2, 16, 29))
    assert made["config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]  # ModelOpt's default
    assert load_eagle3_head(made["folder"], deep).config.layer_ids == (2, 16, 29)


def test_layer_ids_default(tmp_path, target):
    made = make_tiny_head_folder(tmp_path / "h", target, DRAFT_VOCAB, seed=1, config_layer_ids=False)
    config = load_eagle3_head(made["folder"], TargetShape(hidden_size=64, num_layers=16, vocab_size=320)).config
    assert (config.layer_ids, config.layer_ids_source) == ((2, 8, 13), "default")
    assert "L = 16" in config.layer_ids_reason


def test_layer_ids_given_by_the_caller_win(head, shape):
    config = load_eagle3_head(head["folder"], shape, layers=[0, 1, 1]).config
    assert (config.layer_ids, config.layer_ids_source) == ((0, 1, 1), "recipe")


# ------------------------------------------------------------------------------ typed errors


def test_default_layer_ids_outside_a_shallow_target(tmp_path, target, shape):
    made = make_tiny_head_folder(tmp_path / "h", target, DRAFT_VOCAB, seed=1, config_layer_ids=False)
    message = _error(made["folder"], shape)  # 2 layers: default (2, 1, -1)
    assert "[2, 1, -1]" in message and "0..1" in message


def test_config_layer_ids_outside_the_target(head, shape):
    _edit(head["folder"], config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 5]))
    message = _error(head["folder"], shape)
    assert "[1, 2, 6]" in message and "0..1" in message and "[2, 6]" in message


def test_layer_ids_must_be_three_ints(head, shape):
    _edit(head["folder"], config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1]))
    assert "[0, 1]" in _error(head["folder"], shape)


def test_top_level_layer_ids_are_ambiguous(head, shape):
    def move(c):
        c["eagle_aux_hidden_state_layer_ids"] = c.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]

    _edit(head["folder"], config=move)
    assert "top-level eagle_aux_hidden_state_layer_ids [0, -1, 0]" in _error(head["folder"], shape)
    assert load_eagle3_head(head["folder"], shape, layers=(1, 0, 1)).config.layer_ids_source == "recipe"


def test_missing_tensor(head, shape):
    _edit(head["folder"], tensors=lambda t: t.pop("midlayer.hidden_norm.weight"))
    assert "'midlayer.hidden_norm.weight' is missing" in _error(head["folder"], shape)


def test_extra_tensor(head, shape):
    _edit(head["folder"], tensors=lambda t: t.update({"midlayer.self_attn.q_proj.bias": torch.zeros(64)}))
    assert "unexpected tensor 'midlayer.self_attn.q_proj.bias'" in _error(head["folder"], shape)


def test_not_a_head(tmp_path, target, shape):
    target.save_pretrained(tmp_path / "llama")
    message = _error(tmp_path / "llama", shape)
    assert "not an EAGLE-3 head" in message and "fc.weight" in message


def test_shape_mismatch(head, shape):
    _edit(head["folder"], tensors=lambda t: t.update({"midlayer.mlp.down_proj.weight": torch.zeros(64, 96)}))
    message = _error(head["folder"], shape)
    assert "'midlayer.mlp.down_proj.weight'" in message and "[64, 96]" in message and "[64, 128]" in message


def test_fc_width_against_the_target(head):
    wider = TargetShape(hidden_size=48, num_layers=2, vocab_size=320, embedding_width=64)
    _edit(head["folder"], config=lambda c: c.update(target_hidden_size=48))
    message = _error(head["folder"], wider)
    assert "fc.weight input width 192" in message and "144" in message


def test_target_hidden_size_mismatch(head, shape):
    _edit(head["folder"], config=lambda c: c.update(target_hidden_size=48))
    message = _error(head["folder"], shape)
    assert "target_hidden_size 48" in message and "64" in message


def test_qkv_width_must_be_2h(head, shape):
    _edit(head["folder"], tensors=lambda t: t.update({"midlayer.self_attn.k_proj.weight": torch.zeros(32, 64)}))
    message = _error(head["folder"], shape)
    assert "k_proj.weight input width 64" in message and "128" in message


def test_embedding_width_when_present(tmp_path, target, shape):
    made = make_tiny_head_folder(tmp_path / "h", target, DRAFT_VOCAB, seed=2, embed_tokens=True)
    _edit(made["folder"], tensors=lambda t: t.update({"embed_tokens.weight": torch.zeros(320, 32)}))
    message = _error(made["folder"], shape)
    assert "embed_tokens.weight width [32]" in message and "64" in message


def test_embedding_width_of_the_target_when_absent(head):
    narrow = TargetShape(hidden_size=64, num_layers=2, vocab_size=320, embedding_width=48)
    message = _error(head["folder"], narrow)
    assert "width 48" in message and "hidden_size is 64" in message


def test_d2t_out_of_range(head, shape):
    def bad(t):
        t["d2t"][-1] = 1000

    _edit(head["folder"], tensors=bad)
    message = _error(head["folder"], shape)
    assert f"d2t[{DRAFT_VOCAB - 1}] = 1000" in message and "0..319" in message


def test_d2t_duplicate_target(head, shape):
    def bad(t):
        t["d2t"][1] = t["d2t"][0] - 1  # draft id 1 -> the target id of draft id 0

    _edit(head["folder"], tensors=bad)
    assert f"target id {int(head['selected'][0])}" in _error(head["folder"], shape)


def test_t2d_inconsistent_with_d2t(head, shape):
    stray = int(np.setdiff1d(np.arange(320), head["selected"].numpy())[0])

    def bad(t):
        t["t2d"][stray] = True

    _edit(head["folder"], tensors=bad)
    message = _error(head["folder"], shape)
    assert f"t2d marks {DRAFT_VOCAB + 1}" in message and f"target id {stray}" in message


def test_t2d_missing_a_mapped_id(head, shape):
    first = int(head["selected"][0])

    def bad(t):
        t["t2d"][first] = False

    _edit(head["folder"], tensors=bad)
    assert f"target id {first} is mapped by d2t but False in t2d" in _error(head["folder"], shape)


def test_draft_vocab_larger_than_target_vocab(head, shape):
    _edit(head["folder"], config=lambda c: c.update(draft_vocab_size=400))
    assert "draft_vocab_size 400 > the target's vocab size 320" in _error(head["folder"], shape)


def test_unsupported_activation_and_rope(head, shape):
    _edit(head["folder"], config=lambda c: c.update(hidden_act="gelu"))
    assert "hidden_act 'gelu'" in _error(head["folder"], shape)
    llama3 = {"rope_type": "llama3", "factor": 8.0}
    _edit(head["folder"], config=lambda c: c.update(hidden_act="silu", rope_scaling=llama3))
    assert "rope type 'llama3'" in _error(head["folder"], shape)


def test_rope_parameters_and_norm_before_residual(head, shape):
    def v5(c):
        c.pop("rope_theta"), c.pop("rope_scaling")
        c["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}

    _edit(head["folder"], config=v5)
    assert load_eagle3_head(head["folder"], shape).config.rope_theta == 500000.0
    _edit(head["folder"], config=lambda c: c.update(norm_before_residual=True))
    assert "norm_before_residual" in _error(head["folder"], shape)


def test_pickle_refused_without_the_flag_and_read_with_it(head, shape):
    folder = head["folder"]
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    assert "allow_pickle=True" in _error(folder, shape)
    loaded = load_eagle3_head(folder, shape, allow_pickle=True)
    assert torch.equal(loaded.weights["fc.weight"], head["tensors"]["fc.weight"])
    np.testing.assert_array_equal(loaded.draft_to_target(), head["selected"].numpy())


# --------------------------------------------------------------------------------- writing


def test_write_round_trips(head, shape, tmp_path):
    loaded = load_eagle3_head(head["folder"], shape)
    out = write_eagle3_head(loaded, tmp_path / "out" / "head")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] == ["LlamaForCausalLMEagle3"]
    assert (config["model_type"], config["num_hidden_layers"], config["draft_vocab_size"]) == ("llama", 1, DRAFT_VOCAB)
    assert config["target_hidden_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, -1, 0]
    raw = load_file(out / "model.safetensors")
    assert raw["d2t"].dtype == torch.int64 and raw["t2d"].dtype == torch.bool
    again = load_eagle3_head(out, shape)
    assert again.config == loaded.config
    assert again.weights.keys() == loaded.weights.keys()
    assert all(torch.equal(again.weights[n], loaded.weights[n]) for n in loaded.weights)
    np.testing.assert_array_equal(again.d2t, loaded.d2t)
    np.testing.assert_array_equal(again.t2d, loaded.t2d)
    write_eagle3_head(again, out)  # replaces the folder; no temporary folders left behind
    assert sorted(p.name for p in out.parent.iterdir()) == ["head"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_write_failure_leaves_nothing(head, shape, tmp_path):
    loaded = load_eagle3_head(head["folder"], shape)
    broken = Eagle3Head(
        config=loaded.config, weights={**loaded.weights, "fc.weight": "not a tensor"}, d2t=loaded.d2t, t2d=loaded.t2d
    )
    with pytest.raises(AttributeError):
        write_eagle3_head(broken, tmp_path / "out" / "head")
    assert list((tmp_path / "out").iterdir()) == []


# ---------------------------------------------------------------------- reference forward


@pytest.fixture(scope="module")
def ref(tmp_path_factory, target) -> dict:
    made = make_tiny_head_folder(tmp_path_factory.mktemp("ref") / "head", target, DRAFT_VOCAB, seed=5)
    ids = [5, 17, 42, 99, 7, 200, 13, 64, 150, 3]
    feats = target_features(target, ids, made["layer_ids"])  # [S, 3 H_t]
    embed = target.get_input_embeddings().weight.detach()  # [V_t, H]
    return dict(made, ids=ids, feats=feats, embed=embed)


def test_target_features_are_entering_hidden_states(ref, target):
    feats = ref["feats"]
    assert feats.shape == (10, 192)
    emb = target.get_input_embeddings()(torch.tensor(ref["ids"])).detach()
    assert torch.equal(feats[:, 64:128], emb)  # mid = entering layer 0 = the embeddings
    assert torch.equal(feats[:, :64], feats[:, 128:])  # low = high = entering layer 1
    with pytest.raises(ValueError):
        target_features(target, ref["ids"], (0, 1, 2))  # 2 = L: after the final norm


def test_reference_step_chained(ref):
    tensors, cfg = ref["tensors"], ref["config"]
    ids, n = ref["ids"], 6  # target known up to x_6, features rows 0..5
    h = reference_fc(tensors, ref["feats"][:n])  # [6, H]
    logits, hidden, past = reference_step(tensors, cfg, ref["embed"], ids[1 : n + 1], h, None, 0)
    assert logits.shape == (n, DRAFT_VOCAB) and hidden.shape == (n, 64)
    assert past[0].shape == past[1].shape == (2, n, 16)
    assert logits.std() > 1.0  # spread, no near-ties everywhere
    token = int(ref["selected"][int(logits[-1].argmax())])  # draft id -> target id
    for step in range(3):  # chain: own hidden, drafted token, next position
        logits, h_next, past = reference_step(tensors, cfg, ref["embed"], [token], hidden[-1:], past, n + step)
        assert logits.shape == (1, DRAFT_VOCAB) and h_next.shape == (1, 64)
        assert past[0].shape == (2, n + step + 1, 16)
        hidden, token = h_next, int(ref["selected"][int(logits[-1].argmax())])


def test_reference_step_batched_equals_one_row_at_a_time(ref):
    tensors, cfg, ids = ref["tensors"], ref["config"], ref["ids"]
    S = len(ids) - 1
    h = reference_fc(tensors, ref["feats"][:S])
    logits, hidden, past = reference_step(tensors, cfg, ref["embed"], ids[1:], h, None, 0)
    one_past = None
    for t in range(S):
        l1, h1, one_past = reference_step(tensors, cfg, ref["embed"], [ids[t + 1]], h[t : t + 1], one_past, t)
        # fp32 matmuls over 1 row and over S rows differ in low bits on some CPUs (1.3e-5 on a
        # hidden value of 0.45 measured on an AMD EPYC): 1e-5 plus 5e-5 of the value
        torch.testing.assert_close(l1[0], logits[t], atol=1e-5, rtol=5e-5)
        torch.testing.assert_close(h1[0], hidden[t], atol=1e-5, rtol=5e-5)
    torch.testing.assert_close(one_past[0], past[0], atol=1e-5, rtol=5e-5)
    torch.testing.assert_close(one_past[1], past[1], atol=1e-5, rtol=5e-5)


def test_reference_step_matches_transformers_llama_modules(ref):
    """The reference's decoder layer against transformers' LlamaAttention / LlamaMLP /
    LlamaRMSNorm / LlamaRotaryEmbedding holding the head's weights (attention built for a 2H
    input, its o_proj swapped for the head's [H, heads * hd])."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as ml

    tensors, cfg, ids = ref["tensors"], ref["config"], ref["ids"]
    S, H = len(ids) - 1, 64
    common = {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"],
        "attn_implementation": "eager",
    }
    wide, narrow = LlamaConfig(hidden_size=2 * H, **common), LlamaConfig(hidden_size=H, **common)
    attn = ml.LlamaAttention(wide, layer_idx=0)
    attn.o_proj = torch.nn.Linear(64, H, bias=False)
    mlp, rope = ml.LlamaMLP(narrow), ml.LlamaRotaryEmbedding(wide)
    norm_names = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
    norms = {n: ml.LlamaRMSNorm(H, eps=cfg["rms_norm_eps"]) for n in norm_names}
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(attn, name).weight.copy_(tensors[f"midlayer.self_attn.{name}.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, name).weight.copy_(tensors[f"midlayer.mlp.{name}.weight"])
        for name, norm in norms.items():
            norm.weight.copy_(tensors[f"midlayer.{name}.weight"])
        h = reference_fc(tensors, ref["feats"][:S])[None]  # [1, S, H]
        e = ref["embed"][torch.tensor(ids[1:])][None]
        x = torch.cat([norms["input_layernorm"](e), norms["hidden_norm"](h)], dim=-1)  # [1, S, 2H]
        cos_sin = rope(x, torch.arange(S)[None])
        mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
        a = attn(x, position_embeddings=cos_sin, attention_mask=mask)[0] + h
        expected = a + mlp(norms["post_attention_layernorm"](a))
    _, hidden, _ = reference_step(tensors, cfg, ref["embed"], ids[1:], h[0], None, 0)
    torch.testing.assert_close(hidden, expected[0], atol=1e-4, rtol=1e-5)
