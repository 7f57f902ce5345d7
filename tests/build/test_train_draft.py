"""`specexport train-draft` (specexport/train/draft.py): EAGLE-3 head training on the CPU.

A tiny 4-layer llama target (default layer ids (2, L//2, L-3) = (2, 2, 1)) and a tiny text corpus.
The training-time-test alignment is checked against tests/eagle_heads.py's independent reference
forward run the way the runtime drafts: catch up on rows 0..t, then chain with the head's own hidden.
"""

from __future__ import annotations

import inspect
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from eagle_heads import reference_fc, reference_step, target_features
from tiny import make_model, save_hf_folder, write_recipe

from specexport.cli.main import cli
from specexport.formats.eagle3 import TargetShape, load_eagle3_head
from specexport.train.config import CALIBRATE_PROMPTS_PER_DOMAIN, TrainConfig, TrainConfigError, TrainDraftError
from specexport.train.data import Window, choose_draft_vocab, held_out_prompt_ids, load_target, make_batch
from specexport.train.draft import lr_at, train_draft
from specexport.train.head import Eagle3Draft, head_shape, init_from_target, ttt_forward, ttt_losses

PUBLISHED = {
    "fc.weight": (64, 192),
    "midlayer.input_layernorm.weight": (64,),
    "midlayer.hidden_norm.weight": (64,),
    "midlayer.self_attn.q_proj.weight": (64, 128),  # 4 heads x 16, input 2H
    "midlayer.self_attn.k_proj.weight": (32, 128),  # 2 KV heads x 16
    "midlayer.self_attn.v_proj.weight": (32, 128),
    "midlayer.self_attn.o_proj.weight": (64, 64),
    "midlayer.post_attention_layernorm.weight": (64,),
    "midlayer.mlp.gate_proj.weight": (128, 64),
    "midlayer.mlp.up_proj.weight": (128, 64),
    "midlayer.mlp.down_proj.weight": (64, 128),
    "norm.weight": (64,),
    "lm_head.weight": (48, 64),  # DRAFT_VOCAB
}
DRAFT_VOCAB = 48
STEPS = 30
WORDS = [
    "def",
    "add",
    "return",
    "for",
    "in",
    "range",
    "print",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "speculative",
    "decoding",
    "drafts",
    "and",
    "verifies",
    "tokens",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny 4-layer target folder, its recipe, a text corpus and one trained head (STEPS steps)."""
    root = tmp_path_factory.mktemp("train-draft")
    model = make_model("llama", num_hidden_layers=4)
    target_dir = save_hf_folder(model, root / "target")
    recipe = write_recipe(root / "recipe.yaml", target_dir, {"eagle3": {"model": str(root / "head")}}, graph="fused")
    corpus = root / "corpus"
    (corpus / "sub").mkdir(parents=True)
    rng = random.Random(0)
    for i in range(4):
        lines = (" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(30))
        (corpus / ("sub" if i % 2 else "") / f"doc{i}.{['txt', 'py', 'md', 'rst'][i]}").write_text("\n".join(lines))
    (corpus / "skipped.bin").write_bytes(b"\x00\xff" * 100)  # not a data extension
    config = TrainConfig(
        target=str(recipe),
        data=(str(corpus),),
        out=root / "head",
        steps=STEPS,
        batch_size=4,
        seq_len=48,
        lr=3e-3,
        draft_vocab_size=DRAFT_VOCAB,
        eval_every=10,
        save_every=0,
    )
    events: list[dict] = []
    report = train_draft(config, progress=events.append)
    return {
        "root": root,
        "model": model,
        "recipe": recipe,
        "corpus": corpus,
        "config": config,
        "report": report,
        "events": events,
    }


def _windows(report_loss: list[float], n: int = 5) -> tuple[float, float]:
    return float(np.mean(report_loss[:n])), float(np.mean(report_loss[-n:]))


def test_training_loss_falls_and_agreement_is_recorded(setup):
    report = setup["report"]
    assert report.start_step == 0 and report.steps == STEPS and len(report.loss_history) == STEPS
    first, last = _windows(report.loss_history)
    assert last < 0.9 * first, (first, last)
    assert len(report.final_losses) == 3 and all(np.isfinite(report.final_losses))
    assert report.agreement is not None and len(report.agreement) == 3  # one per TTT step
    assert all(0.0 <= a <= 1.0 for a in report.agreement)
    assert [h["step"] for h in report.agreement_history] == [0, 10, 20, 30]
    last = report.agreement_history[-1]
    (source,) = last["by_source"]  # one data source here: its agreement is the overall one
    assert last["by_source"][source] == last["agreement"]
    assert report.layer_ids == (2, 2, 1)  # (2, L//2, L-3) for L = 4
    data = report.data
    assert data["sources"][0]["files_used"] == 4 and data["held_out_windows"] >= 1
    assert data["train_tokens"] + data["held_out_tokens"] == data["sources"][0]["tokens"]
    steps = [e for e in setup["events"] if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1)) and "loss" in steps[0]


def test_output_is_a_published_head(setup):
    out, model = setup["config"].out, setup["model"]
    head = load_eagle3_head(out, TargetShape.from_hf_config(model.config))
    assert {k: tuple(v.shape) for k, v in head.weights.items()} == PUBLISHED  # no embed_tokens: the target's
    assert all(v.dtype == torch.float32 for v in head.weights.values())
    assert head.config.layer_ids == (2, 2, 1) and head.config.layer_ids_source == "config"
    ids = head.draft_to_target()
    assert len(ids) == DRAFT_VOCAB and np.all(np.diff(ids) > 0) and 2 in ids  # sorted, EOS (id 2) always in
    assert np.array_equal(np.flatnonzero(head.t2d), ids)
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]  # output-of-layer ids
    record = json.loads((out / "training.json").read_text())
    assert record["steps"] == STEPS and record["draft_vocab"]["size"] == DRAFT_VOCAB
    assert record["config"]["ttt_steps"] == 3 and record["seconds"]["train"] > 0
    assert (out / "checkpoint" / "state.safetensors").is_file()
    assert not list(out.parent.glob(".head.*"))  # no staging folder left behind


def test_resume_continues_the_step_count(setup):
    root, config = setup["root"], setup["config"]
    out = root / "resumed"
    more = TrainConfig(**{**config.__dict__, "out": out, "steps": STEPS + 6, "resume": config.out})
    report = train_draft(more)
    assert report.start_step == STEPS and report.steps == STEPS + 6
    assert len(report.loss_history) == STEPS + 6
    assert report.loss_history[:STEPS] == setup["report"].loss_history
    assert report.resumed_from == str(config.out / "checkpoint")
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == STEPS + 6 and state["adam_steps"] == STEPS + 6  # AdamW moments went on
    with pytest.raises(TrainDraftError, match="asks for no more"):
        train_draft(TrainConfig(**{**config.__dict__, "out": root / "r2", "steps": STEPS, "resume": config.out}))
    with pytest.raises(TrainDraftError, match="differ from the checkpoint"):
        train_draft(
            TrainConfig(
                **{**config.__dict__, "out": root / "r3", "steps": STEPS + 1, "resume": config.out, "layers": (1, 2, 3)}
            )
        )


def test_ttt_alignment_matches_the_reference_forward(setup):
    """Every TTT step's logits equal the independent reference forward run as the runtime drafts:
    branch t catches up on rows 0..t (fc(features), tokens x_1..x_{t+1}, positions 0..t), then chains
    with the head's own hidden (token x_{t+1+k}, position t+k); and the step-0 loss is the soft
    cross-entropy against the target's renormalised draft-vocabulary distribution of row t+1."""
    model = setup["model"]
    tgt = load_target(str(setup["recipe"]))
    S, layer_ids = 12, (2, 2, 1)
    ids = [int(i) for i in torch.randint(3, 300, (S,), generator=torch.Generator().manual_seed(5))]
    draft_ids = torch.arange(0, 320, 4)  # 80 ids: the target's argmax often falls outside (a real mask)
    head = Eagle3Draft(head_shape(model.config, len(draft_ids)))
    init_from_target(head, model, draft_ids, seed=1)
    with torch.no_grad():  # move away from the structured init so every tensor matters
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    tensors = dict(head.state_dict())
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {**PUBLISHED, "lm_head.weight": (80, 64)}
    cfg = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": model.config.rms_norm_eps,
        "rope_theta": 10000.0,
    }
    embed = model.get_input_embeddings().weight.detach().float()

    batch = make_batch(tgt, [Window(np.asarray(ids, dtype=np.int64))], layer_ids, draft_ids)
    feats = target_features(model, ids, layer_ids)  # [S, 3 H_t], written independently in eagle_heads
    torch.testing.assert_close(batch.features[0], feats, rtol=0, atol=1e-5)
    with torch.no_grad():
        logits = ttt_forward(head, tgt.embed, batch.features, batch.ids, steps=3)
    assert [tuple(lg.shape) for lg in logits] == [(1, S - 1, 80), (1, S - 2, 80), (1, S - 3, 80)]

    fc = reference_fc(tensors, feats)  # [S, H]
    with torch.no_grad():
        for t in range(S - 1):
            ref, hidden, past = reference_step(tensors, cfg, embed, ids[1 : t + 2], fc[: t + 1], None, 0)
            torch.testing.assert_close(logits[0][0, t], ref[t], rtol=1e-4, atol=1e-4)
            h = hidden[t : t + 1]
            for k in (1, 2):
                if t + 1 + k >= S:
                    break
                ref, h, past = reference_step(tensors, cfg, embed, [ids[t + 1 + k]], h, past, t + k)
                torch.testing.assert_close(logits[k][0, t], ref[0], rtol=1e-4, atol=1e-4)

        # step-0 loss, computed directly: row t against the target's logits row t+1 over the draft ids
        full = model(torch.tensor([ids])).logits[0].float()  # [S, V_t]
        ref_logits = reference_step(tensors, cfg, embed, ids[1:S], fc[: S - 1], None, 0)[0]  # [S-1, Vd]
        p = torch.softmax(full[1:S][:, draft_ids], dim=-1)
        ce = -(p * torch.log_softmax(ref_logits, dim=-1)).sum(-1)
        t2d = torch.zeros(320, dtype=torch.bool)
        t2d[draft_ids] = True
        keep = t2d[full[1:S].argmax(-1)]
        assert 0 < int(keep.sum()) < S - 1  # the mask matters in this test
        expected = (ce * keep).sum() / keep.sum()
        losses = ttt_losses(logits, batch, t2d)
    torch.testing.assert_close(losses[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"steps": 0}, r"steps must be an integer in 1\.\.10000000, got 0"),
        ({"steps": 5, "epochs": 1.0}, "not both"),
        ({"lr": -1.0}, r"lr must be a number in \(0, 1\], got -1.0"),
        ({"seq_len": 4}, r"seq_len must be an integer in 16\.\.32768, got 4"),
        ({"ttt_decay": 1.5}, r"ttt_decay must be a number in \(0, 1\], got 1.5"),
        ({"ttt_steps": 0}, r"ttt_steps must be an integer in 1\.\.16, got 0"),
        ({"layers": (1, 2)}, r"layers must be 3 non-negative integers.*\(1, 2\)"),
        ({"held_out": 0.9}, r"held_out must be a number in \[0, 0.5\], got 0.9"),
        ({"schedule": "step"}, "schedule must be one of cosine, linear, got 'step'"),
        ({"draft_vocab_size": 1}, r"draft_vocab_size must be an integer in 2\.\.16777216, got 1"),
        ({"batch_size": True}, "batch_size must be an integer"),
        ({"holdout_limit": 3}, r"holdout_limit must be an integer in 6\.\.100000 \(specexport calibrate"),
        ({"data": ()}, "data must name at least one"),
    ],
)
def test_bad_config_values_give_typed_errors(tmp_path, kwargs, match):
    base = {"target": "x", "data": ("stdlib",), "out": tmp_path / "o"}
    with pytest.raises(TrainConfigError, match=match) as info:
        TrainConfig(**{**base, **kwargs})
    assert "\n" not in str(info.value)


def test_data_and_target_errors(setup, tmp_path):
    config = setup["config"]
    with pytest.raises(TrainDraftError, match="neither a file, a folder"):
        train_draft(TrainConfig(**{**config.__dict__, "out": tmp_path / "a", "data": (str(tmp_path / "missing"),)}))
    small = save_hf_folder(make_model("llama"), tmp_path / "two-layers")  # L = 2: default ids (2, 1, -1) do not fit
    with pytest.raises(TrainDraftError, match=r"outside the target's entering layers 0\.\.1"):
        train_draft(TrainConfig(**{**config.__dict__, "target": str(small), "out": tmp_path / "b"}))
    keep = tmp_path / "user-folder"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    with pytest.raises(TrainDraftError, match="not a train-draft output"):
        train_draft(TrainConfig(**{**config.__dict__, "out": keep}))
    assert (keep / "notes.txt").read_text() == "mine"


def test_calibration_data_holds_out_the_benchmark_prompts(setup, tmp_path):
    config = setup["config"]
    base = {
        **config.__dict__,
        "data": ("calibration",),
        "steps": 2,
        "answer_tokens": 3,
        "cache_dir": tmp_path / "cache",
    }
    with pytest.raises(TrainDraftError, match="held out as the benchmark's"):  # bench's default: every prompt
        train_draft(TrainConfig(**{**base, "out": tmp_path / "a"}))
    report = train_draft(TrainConfig(**{**base, "out": tmp_path / "b", "holdout_limit": 31}))
    held = held_out_prompt_ids(["all"], 31)
    info = report.data["sources"][0]
    total = len(held_out_prompt_ids(["all"], None))
    assert info["prompts_held_out"] == len(held) and info["prompts"] == total - len(held)
    assert len(held) == sum(min(31, n) for n in (33, 32, 32, 32, 32, 32, 30, 32))  # first 31 of each domain
    assert info["answers_generated"] == info["prompts"] and list((tmp_path / "cache").glob("answers-*.json"))
    cached = json.loads(next((tmp_path / "cache").glob("answers-*.json")).read_text())
    assert not {key.split("|")[0] for key in cached} & set(held)
    again = train_draft(TrainConfig(**{**base, "out": tmp_path / "b", "holdout_limit": 31}))
    assert again.data["sources"][0]["answers_generated"] == 0  # cached


def test_calibrate_default_is_held_out():
    from specexport.bench.calibrate import calibrate

    assert inspect.signature(calibrate).parameters["prompts_per_domain"].default == CALIBRATE_PROMPTS_PER_DOMAIN


def test_draft_vocab_and_schedule():
    windows = [Window(np.array([5, 5, 5, 7, 7, 9, 1])), Window(np.array([7, 3]))]
    ids, coverage = choose_draft_vocab(windows, 4, 12, eos_ids=[11])
    assert ids.tolist() == [1, 5, 7, 11]  # EOS, then by count (ties: lower id), sorted by id
    assert coverage == pytest.approx(7 / 9)
    config = TrainConfig(target="x", data=("stdlib",), out=Path("o"), lr=1e-3, warmup=0.1)
    assert lr_at(0, 100, config) == pytest.approx(1e-4)
    assert lr_at(9, 100, config) == pytest.approx(1e-3)
    assert lr_at(99, 100, config) == pytest.approx(1e-4, rel=0.01)  # decays to 10% of the peak


def test_cli_train_draft_json(setup, tmp_path):
    args = [
        "train-draft",
        str(setup["recipe"]),
        "--data",
        str(setup["corpus"]),
        "--out",
        str(tmp_path / "h"),
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--draft-vocab-size",
        "40",
        "--eval-every",
        "2",
        "--threads",
        "1",
        "--json",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 3 and summary["draft_vocab"]["size"] == 40 and len(summary["agreement"]) == 3
    bad = CliRunner().invoke(cli, [*args[:-1], "--layers", "1,2"])
    assert bad.exit_code == 2 and bad.stderr.strip().count("\n") == 0 and "layers must be 3" in bad.stderr
    shutil.rmtree(tmp_path / "h")
