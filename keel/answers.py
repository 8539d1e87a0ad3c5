"""Answer normalisation, EM and F1 exactly as paper B's released reward code computes them.

normalise: lowercase, every non-word character becomes a space, spaces collapse.
EM: the normalised answer equals the normalised primary answer or any other answer/alias;
an empty answer scores 0. F1: token F1 against the primary gold answer only.
"""

from __future__ import annotations

import re
from collections import Counter

_SPACES = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Lowercase, non-word characters → space, collapse spaces.

    "Non-word" follows Python's `\\W` (so "_" is a word character and survives): this is what
    `re.sub(r"\\W", " ", s)` in the authors' code does.
    >>> normalise("  The  Eiffel-Tower! ")
    'the eiffel tower'
    """
    return _SPACES.sub(" ", re.sub(r"\W", " ", text.lower())).strip()


def exact_match(answer: str | None, golds: list[str]) -> float:
    """1.0 if the normalised answer equals any normalised gold string, else 0.0."""
    if answer is None:
        return 0.0
    a = normalise(answer)
    if not a:
        return 0.0
    return 1.0 if any(a == normalise(g) for g in golds if g is not None) else 0.0


def f1_score(answer: str | None, gold: str) -> float:
    """Token F1 between the normalised answer and the normalised gold answer.

    Worked example: answer "new york city", gold "new york" → common 2, precision 2/3,
    recall 2/2, F1 = 2·(2/3)·1 / (2/3 + 1) = 0.8.
    """
    if answer is None:
        return 0.0
    pred = normalise(answer).split()
    ref = normalise(gold).split()
    if not pred or not ref:
        return 0.0
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred)
    recall = common / len(ref)
    return 2 * precision * recall / (precision + recall)
