"""ETS buffer: which prompts enter and leave it, its SFT examples, and resume."""

from __future__ import annotations

import pytest

from keel.signals.ets import ETSBuffer
from keel.sft import decompose, gold_trajectory
from keel.types import Source
from test_signals_ops import KG_ENV, kg_task


def test_only_the_group_that_failed_entirely_enters():
    buf = ETSBuffer(window=10, capacity=8)
    entered = buf.observe(1, ["a", "b", "c"], [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5]])
    assert entered == 1 and buf.task_ids() == ["a"] and buf.entries == {"a": 1}


def test_window_success_capacity_and_threshold():
    buf = ETSBuffer(window=3, capacity=2)
    buf.observe(1, ["a"], [[0.0, 0.0]])
    buf.observe(3, ["b"], [[0.0]])
    assert buf.entries == {"a": 1, "b": 3}
    buf.observe(4, ["c"], [[1.0]])  # 4 - 1 = 3 steps since a failed: out of the window
    assert buf.task_ids() == ["b"]
    buf.observe(5, ["b"], [[0.0, 0.25]])  # b now succeeds (reward > 0): no longer erroneous
    assert buf.task_ids() == []
    buf.observe(6, ["x", "y"], [[0.0], [0.0]])
    buf.observe(7, ["x"], [[0.0]])  # x fails again: newest now
    buf.observe(7, ["z"], [[0.0]])  # capacity 2: the oldest failure (y, step 6) is evicted
    assert buf.entries == {"x": 7, "z": 7}
    loose = ETSBuffer(window=5, capacity=4, fail_at=0.2)
    loose.observe(1, ["p", "q"], [[0.1, 0.2], [0.1, 0.3]])
    assert loose.task_ids() == ["p"]


def test_bad_input():
    with pytest.raises(ValueError, match="window must be >= 1"):
        ETSBuffer(window=0)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ETSBuffer(capacity=0)
    buf = ETSBuffer()
    with pytest.raises(ValueError, match="2 task ids but 1 groups"):
        buf.observe(1, ["a", "b"], [[0.0]])
    with pytest.raises(ValueError, match="task 'a' has an empty group"):
        buf.observe(1, ["a"], [[]])
    with pytest.raises(ValueError, match=r"expected \{'entries'"):
        buf.load_state_dict({"entries": [["a", "1"]]})


def test_state_dict_round_trip():
    buf = ETSBuffer(window=4, capacity=3)
    buf.observe(2, ["a", "b"], [[0.0], [0.0]])
    buf.observe(3, ["a"], [[0.0]])
    state = buf.state_dict()
    assert state == {"window": 4, "capacity": 3, "fail_at": 0.0, "entries": [["b", 2], ["a", 3]]}
    resumed = ETSBuffer(window=4, capacity=3)
    resumed.load_state_dict(state)
    resumed.observe(6, ["c"], [[1.0]])  # b (6 - 2 = 4) expires, a (6 - 3 = 3) stays, exactly as in the original
    buf.observe(6, ["c"], [[1.0]])
    assert resumed.entries == buf.entries == {"a": 3}


def test_sft_examples_are_the_gold_single_steps(tiny):
    _, tok = tiny
    good, broken = kg_task(), kg_task("film.film.no_such_relation")
    broken.id = "broken"
    buf = ETSBuffer()
    buf.observe(1, ["t0", "broken"], [[0.0], [0.0]])
    examples = buf.sft_examples(tok, KG_ENV, {"t0": good, "broken": broken})
    gold = gold_trajectory(tok, KG_ENV, good)
    want = decompose(gold)
    assert len(examples) == 3  # two call turns + the answer turn; the broken gold gives none
    assert [(e.token_ids, e.targets, e.turn) for e in examples] == [(w.token_ids, w.targets, w.turn) for w in want]
    for e, (a, b) in zip(examples, gold.turn_spans):
        assert [i for i, t in enumerate(e.targets) if t] == list(range(a, b))
        assert all(gold.sources[i] == Source.EXPERT for i in range(a, b))
    assert len(buf.sft_examples(tok, KG_ENV, {"t0": good, "broken": broken}, packed=True)) == 1
    with pytest.raises(ValueError, match="buffered task 'broken' is not among the 1 tasks"):
        buf.sft_examples(tok, KG_ENV, {"t0": good})
