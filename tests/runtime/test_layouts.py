"""contract.KvLayout: each layout's facts, looked up once from the manifest's kv_layout string or a
recipe's graph form, and the names, shapes and versions GraphSpec derives from them."""

from __future__ import annotations

import pytest

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec


def test_layout_facts():
    tm, hm = contract.layout_of(contract.TIME_MAJOR), contract.layout_of(contract.HEAD_MAJOR_INPLACE)
    assert (tm.form, hm.form) == ("portable", "fused") and contract.GRAPH_FORMS == ("portable", "fused")
    assert contract.layout_for_form("fused") is hm and contract.layout_for_form("portable") is tm
    assert tm.cache_shape(7, 3, 64) == (1, 7, 3, 64) and hm.cache_shape(7, 3, 64) == (1, 3, 7, 64)
    assert (tm.time_axis, tm.heads_axis, hm.time_axis, hm.heads_axis) == (1, 2, 2, 1)
    assert tm.kv_outputs(2) == ("new_key_2", "new_value_2") and hm.kv_outputs(2) == ("present_key_2", "present_value_2")
    assert tm.cursor_inputs == () and hm.cursor_inputs == (contract.SEQLENS_K, contract.TOTAL_SEQUENCE_LENGTH)
    assert not tm.in_place and hm.in_place and not tm.contrib_attention and hm.contrib_attention
    with pytest.raises(ValueError, match="paged"):
        contract.layout_of("paged")
    with pytest.raises(ValueError, match="portable"):
        contract.layout_for_form("paged")


@pytest.mark.parametrize(
    "kv_layout, min_rows, head, windowed, version",
    [
        ("time_major", 1, False, False, "1.0"),
        ("time_major", 2, False, True, "1.2"),
        ("time_major", 1, True, False, "1.3"),
        ("head_major_inplace", 1, False, False, "1.1"),
        ("head_major_inplace", 2, False, False, "1.2"),
        ("head_major_inplace", 1, True, False, "1.2"),
        ("head_major_inplace", 1, False, True, "1.4"),
    ],
)
def test_versions_per_layout(kv_layout, min_rows, head, windowed, version):
    assert contract.version_for(kv_layout, min_rows, head=head, windowed=windowed) == version


def test_graph_spec_takes_its_layout_once():
    spec = GraphSpec(2, 3, 64, 320, kv_layout=contract.HEAD_MAJOR_INPLACE)
    assert spec.layout is contract.LAYOUTS[contract.HEAD_MAJOR_INPLACE] and spec.kv_layout == "head_major_inplace"
    assert spec.cache_shape(10) == (1, 3, 10, 64)
    assert spec.input_names()[2:4] == [contract.SEQLENS_K, contract.TOTAL_SEQUENCE_LENGTH]
    assert spec.output_names()[1:3] == ["present_key_0", "present_value_0"]
    assert spec == GraphSpec(2, 3, 64, 320, kv_layout="head_major_inplace") != GraphSpec(2, 3, 64, 320)
    assert "layout=" not in repr(spec).replace("kv_layout=", "")  # the manifest's string is the record
    with pytest.raises(ValueError, match="kv_layout 'paged'"):
        GraphSpec(2, 3, 64, 320, kv_layout="paged")


def test_recipe_layout_follows_its_graph_form():
    from specexport.recipe.load import load_recipe, resolve_recipe

    recipe = load_recipe(resolve_recipe("smollm2-135m"))
    assert recipe.layout is contract.layout_for_form(recipe.graph)
