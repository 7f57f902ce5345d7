"""What the batch tests share: prompts of mixed lengths (1 to ~60 tokens, some repeating text
for the lookup proposers) and a generator pair of one artifact with its solo greedy outputs."""

from __future__ import annotations

from specexport_runtime.api import load

PROMPTS = [
    "def add(a, b):",
    "hello world hello world hello",
    "x = 1\ny = 2\nx = 1\ny =",
    "abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc",
    "the quick brown",
    "for i in range(10):\n    print(i)\nfor i in range(10):",
    "a",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen one two",
]


def generator_pair(root):
    """(batch-1 generator, batch generator) of one artifact."""
    return load(root), load(root, batch=True)


def solo_greedy(solo, prompts, max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy target-only tokens from the batch-1 generator."""
    return [solo.generate(p, max_new_tokens=max_new_tokens, speculative=False).token_ids for p in prompts]
