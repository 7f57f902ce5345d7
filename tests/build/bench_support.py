"""Helpers of the bench and calibrate tests (no tests here): the tiny prompt set (as JSONL lines and
as Prompts) that test_bench.py, test_bench_modes.py, test_calibrate.py and test_bench_cli.py use,
and a copy of an artifact to calibrate."""

from __future__ import annotations

import shutil
from pathlib import Path

from specexport.bench.prompts import Prompt

NEW = 12
LINES = [
    {"id": "t-code-1", "domain": "code", "text": "def add(a, b):\n", "max_new_tokens": NEW},
    {
        "id": "t-code-2",
        "domain": "code",
        "messages": [{"role": "user", "content": "for i in range(10):"}],
        "max_new_tokens": NEW,
    },
    {
        "id": "t-chat-1",
        "domain": "chat",
        "messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_new_tokens": NEW,
    },
    {"id": "t-copy-1", "domain": "copy_edit", "text": '{"name": "specexport", "version": 1}', "max_new_tokens": NEW},
]


def _prompt(line: dict) -> Prompt:
    msgs = tuple((m["role"], m["content"]) for m in line["messages"]) if "messages" in line else None
    return Prompt(
        id=line["id"],
        domain=line["domain"],
        messages=msgs,
        text=line.get("text"),
        max_new_tokens=line["max_new_tokens"],
    )


PROMPTS = [_prompt(line) for line in LINES]


def _copy(artifact: Path, tmp_path: Path) -> Path:
    """Calibration writes into the artifact: never into the session-wide fixtures."""
    return Path(shutil.copytree(artifact, tmp_path / "artifact"))
