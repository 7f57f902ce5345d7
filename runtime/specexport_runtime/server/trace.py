"""How each streamed token came about (a request's `trace: true`, shown by the web page): the kinds
of one round's tokens from the difference of its generation counters before and after the round.

    forced      drafted because the grammar forces it, and kept
    accepted    drafted by the proposer and accepted by the target
    correction  the target's token after a rejected draft token
    bonus       the target's token after every draft token was accepted
    target      a plain target step (the prefill's token, or a round without a draft)

A round emits [forced..., accepted..., correction | bonus] (speculative) or [target] (plain);
a stop at EOS may end the list early.
"""

from __future__ import annotations

from collections.abc import Sequence

KINDS = ("forced", "accepted", "correction", "bonus", "target")


def counters(stats) -> tuple[int, int, int, int, int]:
    """(rounds, accepted, forced_accepted, corrections, bonus) of a GenerationStats now."""
    return stats.rounds, stats.accepted, stats.forced_accepted, stats.corrections, stats.bonus


def round_kinds(before: tuple, after: tuple, n_tokens: int) -> list[str]:
    """The kinds of a round's n_tokens emitted tokens, from counters() before and after it."""
    rounds, accepted, forced, corrections, _ = (a - b for a, b in zip(after, before))
    if rounds == 0:
        kinds = ["target"] * n_tokens
    else:
        kinds = ["forced"] * forced + ["accepted"] * accepted + ["correction" if corrections else "bonus"]
    return kinds[:n_tokens]


def trace_items(codec, tokens: Sequence[int], kinds: Sequence[str]) -> list[dict]:
    """[{"text": one token's text (decoded alone), "kind"}] of a round."""
    return [{"text": codec.decode([int(t)]), "kind": k} for t, k in zip(tokens, kinds)]
