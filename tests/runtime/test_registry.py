"""The proposer registry answers every "which proposers" question of the manifest, the recipe,
the generator, calibrate and the CLIs; a proposer registered from outside joins all of them."""

from __future__ import annotations

import pytest

from specexport_runtime import registry
from specexport_runtime.contract import ASSISTANT, DECODER, EAGLE3_HEAD, MTP
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.registry import ProposerSpec


def test_the_built_in_proposers():
    assert registry.names() == ("draft", "ngram", "hybrid", "eagle", "dflash", "suffix", "assistant", "mtp", "none")
    assert registry.speculative_names() == ("draft", "ngram", "hybrid", "eagle", "dflash", "suffix", "assistant", "mtp")
    assert registry.available(MTP) == ("ngram", "suffix", "mtp") and registry.recipe_default(MTP) == "mtp"
    assert registry.available(ASSISTANT) == ("ngram", "suffix", "assistant")
    assert registry.recipe_default(ASSISTANT) == "assistant"
    assert registry.available(None) == ("ngram", "suffix")
    assert registry.available(DECODER) == ("draft", "ngram", "hybrid", "suffix")
    assert registry.available(EAGLE3_HEAD) == ("ngram", "hybrid", "eagle", "suffix")
    assert [registry.recipe_choices(k) for k in (DECODER, EAGLE3_HEAD, None)] == [
        ("draft", "hybrid"),
        ("eagle", "hybrid"),
        ("ngram",),
    ]
    assert [registry.recipe_default(k) for k in (DECODER, EAGLE3_HEAD, None)] == ["draft", "eagle", "ngram"]
    assert registry.calibrated(DECODER) == ("draft", "ngram") and registry.calibrated(EAGLE3_HEAD) == ("eagle", "ngram")
    assert registry.calibration_name("hybrid", EAGLE3_HEAD) == "eagle"
    assert registry.calibration_name("hybrid", DECODER) == "draft" and registry.calibration_name("none", None) is None
    assert {n for n in registry.names() if registry.get(n).free} == {"ngram", "suffix", "none"}


@pytest.mark.parametrize(
    "name, kind, message",
    [
        (
            "medusa",
            None,
            "proposer 'medusa' is not one of 'draft', 'ngram', 'hybrid', 'eagle', 'dflash', 'suffix', 'assistant',"
            " 'mtp', 'none'",
        ),
        ("hybrid", None, "proposer 'hybrid' needs an artifact with a draft model; this one has none (use 'ngram')"),
        (
            "eagle",
            DECODER,
            "proposer 'eagle' needs an artifact with an EAGLE-3 draft head; this artifact's draft is a"
            " draft model (use 'draft' or 'hybrid')",
        ),
        (
            "draft",
            EAGLE3_HEAD,
            "proposer 'draft' needs a draft model; this artifact's draft is an EAGLE-3 head (use 'eagle' or 'hybrid')",
        ),
    ],
)
def test_what_an_artifact_lacks_is_named(name, kind, message):
    with pytest.raises(InvalidArgument) as info:
        registry.check_available(name, kind)
    assert str(info.value) == message


def test_a_registered_proposer_joins_every_list_and_leaves():
    spec = ProposerSpec("echo", lambda ctx: None, "test", recipe=True, calibrate=registry.LOOP)
    with registry.extended(spec):
        assert registry.names()[-1] == "echo" and "echo" in registry.available(None)
        assert "echo" in registry.recipe_choices(None) and "echo" in registry.calibrated(DECODER)
        with pytest.raises(InvalidArgument, match="registered already"):
            registry.register(spec)
    assert "echo" not in registry.names()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"name": "Echo"}, "lower-case"),
        ({"needs": ("transformer",)}, "'transformer' is not a draft graph kind"),
        ({"calibrate": "sometimes"}, "calibrate 'sometimes'"),
    ],
)
def test_a_bad_spec_is_refused(kwargs, words):
    with pytest.raises(InvalidArgument, match=words):
        ProposerSpec(**{"name": "echo", "factory": "x:y", "label": "x", **kwargs})


def test_factories_resolve_lazily_and_the_registry_stays_lean(tmp_path):
    """Factories are "module:function" strings, imported on first use: the registry (read by the
    manifest and the build side) does not start ONNX Runtime."""
    import subprocess
    import sys

    probe = "import sys, specexport_runtime.registry as r; print('onnxruntime' in sys.modules, len(r.names()))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "9"]
    assert callable(registry.resolve(registry.get("hybrid").factory))
