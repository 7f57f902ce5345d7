"""`train-draft --data instructions` (specexport/train/instructions.py): requests synthesized from
local material, answered by the target in batches."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from tiny import make_model, save_hf_folder, write_recipe

from specexport.train import instructions as ti
from specexport.train.config import TrainConfig, TrainConfigError
from specexport.train.draft import train_draft

MODULE = textwrap.dedent('''
    """A module."""

    def public_thing(path, mode="r"):
        """Open the file at path and return its first line.

        More text that is not the summary."""
        return open(path, mode).readline()

    def _private(x):
        """Hidden helper that must never be used."""
        return x

    def no_doc(x):
        return x

    def tiny(x):
        """Short."""
        return x

    class Thing:
        def method(self):
            """A method is not a top-level function."""
''')


def test_stdlib_functions_take_public_documented_functions(tmp_path):
    (tmp_path / "mod.py").write_text(MODULE)
    (tmp_path / "broken.py").write_text("def f(:\n")  # a syntax error: skipped
    (tmp_path / "_internal.py").write_text(MODULE)  # private module: skipped
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "sub.py").write_text(MODULE)
    found = ti.stdlib_functions(root=tmp_path)
    assert sorted((f.module, f.name) for f in found) == [("mod", "public_thing"), ("pkg.sub", "public_thing")]
    f = found[0]
    assert f.args == ("path", "mode") and f.summary == "Open the file at path and return its first line"
    assert f.source.startswith("def public_thing(path") and f.source.rstrip().endswith("readline()")


def test_doc_paragraphs_keep_prose_only(tmp_path):
    prose = (
        "The quick brown fox jumps over the lazy dog while the speculative decoder verifies every drafted "
        "token in one call."
    )
    (tmp_path / "README.md").write_text(
        f"# Title\n\n{prose}\n\n| a | b |\n|---|---|\n\n```\ncode [x] {{y}}\n```\n\nShort.\n"
    )
    stdlib = tmp_path / "std"
    stdlib.mkdir()
    doc = "This module keeps a small cache of recently used objects and evicts the oldest one when it is full."
    (stdlib / "m.py").write_text(f'"""{doc}\n\nx = [1] {{2}}\n"""\n')
    assert sorted(ti.doc_paragraphs(root=tmp_path, stdlib=stdlib)) == sorted([prose, doc])


def test_synthesize_is_seeded_and_covers_the_domains():
    fns = [
        ti.Function("m", f"f{i}", ("a",), f"Compute the value number {i} of a list", f"def f{i}(a):\n    return a")
        for i in range(5)
    ]
    paras = [f"Paragraph {i} explains one thing about caches and how they are evicted over time." for i in range(5)]
    a = ti.synthesize(25, seed=3, functions=fns, paragraphs=paras)
    assert a == ti.synthesize(25, seed=3, functions=fns, paragraphs=paras)
    assert a != ti.synthesize(25, seed=4, functions=fns, paragraphs=paras)
    assert [d for d, _ in a[:5]] == list(ti.DOMAINS) and len(a) == 25
    assert all(isinstance(r, str) and len(r) > 10 for _, r in a)
    with pytest.raises(ValueError, match="0 stdlib functions"):
        ti.synthesize(3, functions=[], paragraphs=paras)


def test_batched_answers_equal_one_by_one_greedy_answers():
    """Left padding must not change what a prompt's answer is (the reference is transformers'
    unbatched greedy generate), answers come back in the prompts' order, and stop after EOS."""
    torch.manual_seed(0)
    model = make_model("llama", num_hidden_layers=2).eval()
    vocab = model.config.vocab_size
    prompts = [[int(t) for t in torch.randint(3, vocab, (n,))] for n in (5, 9, 3, 7, 12)]
    pad = 0
    got = ti.answer(model, pad, prompts, max_new_tokens=6, batch=3)
    for p, a in zip(prompts, got):
        ids = torch.tensor([p])
        ref = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=pad
        )[0, len(p) :].tolist()
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        cut = next((j + 1 for j, t in enumerate(ref) if t in eos), len(ref))
        assert a == ref[:cut]


def test_instructions_source_in_train_draft(tmp_path, monkeypatch):
    """data 'instructions' answers each synthesized request once (cached) and trains on prompt + answer."""
    fns = [
        ti.Function("m", "add", ("a", "b"), "Add two numbers and return the sum", "def add(a, b):\n    return a + b")
    ]
    paras = ["A cache keeps recently used values close at hand so that the program does not compute them again."]
    monkeypatch.setattr(ti, "stdlib_functions", lambda seed=0: fns)
    monkeypatch.setattr(ti, "doc_paragraphs", lambda seed=0: paras)
    target = save_hf_folder(make_model("llama", num_hidden_layers=4), tmp_path / "target")
    recipe = write_recipe(
        tmp_path / "recipe.yaml", target, {"eagle3": {"model": str(tmp_path / "head")}}, graph="fused"
    )
    base = dict(
        target=str(recipe),
        data=("instructions",),
        steps=2,
        batch_size=2,
        seq_len=48,
        draft_vocab_size=48,
        eval_every=1,
        save_every=0,
        instructions=7,
        instruction_tokens=5,
        answer_batch=3,
        cache_dir=tmp_path / "cache",
    )
    report = train_draft(TrainConfig(out=tmp_path / "a", **base))
    info = report.data["sources"][0]
    assert info["source"] == "instructions" and info["requests"] == 7 and info["answers_generated"] >= 1
    assert sum(info["by_domain"].values()) == 7 and set(info["by_domain"]) == set(ti.DOMAINS)
    cached = json.loads(next((tmp_path / "cache").glob("instructions-*.json")).read_text())
    assert all(1 <= len(a) <= 5 for a in cached.values())
    again = train_draft(TrainConfig(out=tmp_path / "b", **base))
    assert again.data["sources"][0]["answers_generated"] == 0  # cached


@pytest.mark.parametrize("key", ["instructions", "instruction_tokens", "answer_batch"])
def test_instruction_options_are_validated(tmp_path, key):
    with pytest.raises(TrainConfigError, match=key):
        TrainConfig(target="x", data=("instructions",), out=tmp_path, **{key: 0})
