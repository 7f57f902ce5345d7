"""The recipe's speculation section reaches the runtime through the manifest: what `hybrid`
retrieves with and whether gamma adapts are recorded at build time and become the generator's
default GeneratorConfig."""

from __future__ import annotations

import yaml
from tiny import make_model, save_hf_folder, write_recipe

from specexport.build.artifact import build_artifact
from specexport.recipe.load import load_recipe
from specexport_runtime.api import load
from specexport_runtime.config import ARTIFACT
from specexport_runtime.manifest import read_manifest


def test_hybrid_retrieval_and_adaptive_reach_the_generator(tmp_path):
    target = save_hf_folder(make_model(), tmp_path / "target-hf")
    recipe = write_recipe(tmp_path / "recipe.yaml", target, {"proposer": "ngram"}, name="tiny-spec", gamma=3)
    data = yaml.safe_load(recipe.read_text())
    data["speculation"].update(hybrid_retrieval="lookup", adaptive=False)
    data["validation"] = {"enabled": False}
    recipe.write_text(yaml.safe_dump(data))
    build_artifact(load_recipe(recipe), tmp_path / "artifact")
    manifest = read_manifest(tmp_path / "artifact")
    assert manifest.speculation.hybrid_retrieval == "lookup" and manifest.adaptive is False
    gen = load(tmp_path / "artifact")
    assert (gen.config.hybrid_retrieval, gen.config.adaptive, gen.config.initial_gamma) == ("lookup", False, 3)
    run = gen.events([40, 41, 42, 43] * 4, max_new_tokens=12)
    run.collect()
    assert run.gamma_policy == ARTIFACT and all(k <= 3 for k, _ in run.stats.round_sizes)
