"""One contract version: README and docs/graph-contract.md name the version contract.py defines."""

from __future__ import annotations

import re
from pathlib import Path

from specexport_runtime.contract import CONTRACT_VERSION

ROOT = Path(__file__).resolve().parents[2]


def test_readme_and_the_contract_doc_name_the_codes_version():
    heading = (ROOT / "docs" / "graph-contract.md").read_text().splitlines()[0]
    assert heading == f"# Graph contract, version {CONTRACT_VERSION}"
    readme = (ROOT / "README.md").read_text()
    named = re.findall(r"docs/graph-contract\.md\) \(version (\d+\.\d+)", readme)
    assert named == [CONTRACT_VERSION]
