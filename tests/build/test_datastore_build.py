"""A recipe with `retrieval: {corpus: ...}` builds a corpus datastore into the artifact; inspect
shows it; the suffix proposer drafts from it (source suffix-datastore) and greedy output stays
equal to target-only although the corpus contradicts the target."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from tiny import make_model, save_hf_folder, write_recipe

from specexport.build.artifact import build_artifact
from specexport.cli.main import cli
from specexport.recipe.load import load_recipe
from specexport_runtime.api import load
from specexport_runtime.errors import ChecksumError

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):"]
CORPUS = "\n".join(
    [
        "def add(a, b):\n    return a - b  # a corpus that disagrees with the random target",
        "The quick brown fox jumps over the lazy dog again and again.",
        "for i in range(10):\n    print(i * i)\n",
    ]
    * 3
)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    work = tmp_path_factory.mktemp("datastore")
    (work / "corpus").mkdir()
    (work / "corpus" / "doc.txt").write_text(CORPUS, encoding="utf-8")
    (work / "corpus" / "more.md").write_text("return a - b\n" * 4, encoding="utf-8")
    target = save_hf_folder(make_model(), work / "target-hf")
    recipe = write_recipe(work / "recipe.yaml", target, {"proposer": "ngram", "ngram_sizes": [3, 2, 1]}, name="tiny-ds")
    data = yaml.safe_load(recipe.read_text())
    data["retrieval"] = {
        "corpus": [str(work / "corpus" / "*.txt"), str(work / "corpus" / "more.md")],
        "max_tokens": 5000,
    }
    recipe.write_text(yaml.safe_dump(data))
    build_artifact(load_recipe(recipe), work / "artifact")
    return work / "artifact"


def test_manifest_and_inspect_show_the_datastore(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    r = manifest["retrieval"]
    assert r["token_count"] > 50 and r["info"]["documents"] == 2 and r["info"]["files"] == 2
    assert {r["tokens"], r["suffix_array"]} <= set(manifest["files"])  # checksummed like every file
    tokens = np.load(artifact / r["tokens"])
    assert tokens.dtype == np.int32 and (tokens == -1).sum() == 2
    out = CliRunner().invoke(cli, ["inspect", str(artifact)])
    assert out.exit_code == 0 and "datastore:" in out.output and f"{r['token_count']:,} tokens" in out.output


def test_suffix_drafts_from_the_datastore_and_stays_exact(artifact):
    gen = load(artifact)
    assert gen.datastore is not None and isinstance(gen.datastore.tokens, np.memmap)
    sources: dict[str, list[int]] = {}
    for gamma in (2, None):
        for p in PROMPTS:
            base = gen.generate(p, max_new_tokens=40, speculative=False)
            gen.forget_history()
            got = gen.generate(p, max_new_tokens=40, proposer="suffix", gamma=gamma)
            assert got.token_ids == base.token_ids, p
            for s, v in got.stats.by_source.items():
                sources.setdefault(s, [0, 0, 0])
                sources[s] = [a + b for a, b in zip(sources[s], v)]
    assert sources["suffix-datastore"][1] > 0  # the corpus drafted
    gen.forget_history()
    off = gen.generate(PROMPTS[0], max_new_tokens=40, proposer="suffix", use_datastore=False)
    assert "suffix-datastore" not in off.stats.by_source


def test_a_modified_datastore_fails_the_checksum(artifact, tmp_path):
    import shutil

    copy = shutil.copytree(artifact, tmp_path / "copy")
    tokens = np.load(copy / "retrieval" / "tokens.npy")
    tokens[0] += 1
    np.save(copy / "retrieval" / "tokens.npy", tokens)
    with pytest.raises(ChecksumError, match="retrieval/tokens.npy"):
        load(copy)


@pytest.mark.parametrize(
    "retrieval, message",
    [
        ({"corpus": []}, "retrieval.corpus = \\[\\] is not allowed"),
        ({"corpus": ["a"], "max_tokens": 3}, "retrieval.max_tokens = 3 is out of range"),
        ({"corpus": ["a"], "size": 3}, "unknown key 'size' in section 'retrieval'"),
        ({"max_tokens": 100}, "required key 'retrieval.corpus' is missing"),
    ],
)
def test_bad_retrieval_sections(tmp_path, retrieval, message):
    from specexport.errors import RecipeError
    from specexport.recipe.load import parse_recipe

    data = yaml.safe_load(write_recipe(tmp_path / "r.yaml", tmp_path, {"proposer": "ngram"}).read_text())
    data["retrieval"] = retrieval
    with pytest.raises(RecipeError, match=message):
        parse_recipe(data)
