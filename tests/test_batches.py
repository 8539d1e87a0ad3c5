"""Which training tasks an RL step takes: a plain shuffle, or one stratified by a meta key."""

import random
from types import SimpleNamespace

import pytest

from keel.run import next_batch, stratified_order
from keel.tasks import DataError, strata
from keel.types import Task


def test_stratified_order_takes_the_values_in_turn():
    values = ["a", "a", "a", "b", "b", "c"]
    order = stratified_order(random.Random(0), values)
    assert sorted(order) == list(range(6))
    rounds = [order[:3], order[3:5], order[5:]]  # a, b, c; then a, b; then a
    assert [sorted(values[i] for i in r) for r in rounds] == [["a", "b", "c"], ["a", "b"], ["a"]]


def test_every_batch_holds_each_template_once_across_epochs():
    values = ["x", "y", "z"] * 4
    run, order = SimpleNamespace(rng=random.Random(3)), []
    seen = []
    for _ in range(8):  # two epochs of four batches
        batch = next_batch(run, order, 3, len(values), values)
        assert sorted(values[i] for i in batch) == ["x", "y", "z"]
        seen += batch
    assert sorted(seen[:12]) == sorted(seen[12:]) == list(range(12))  # each epoch is every task once


def test_without_strata_the_order_is_the_plain_shuffle():
    run, order = SimpleNamespace(rng=random.Random(7)), []
    expected = list(range(10))
    random.Random(7).shuffle(expected)
    assert next_batch(run, order, 4, 10) == expected[::-1][:4]


def _task(i, meta):
    return Task(id=f"t{i}", question="q", answers=["a"], meta=meta)


def test_strata_reads_the_meta_key_and_names_a_task_without_it():
    tasks = [_task(0, {"template": "spouse"}), _task(1, {"template": 3})]
    assert strata(tasks, "template") == ["spouse", "3"]
    assert strata(tasks, "") is None
    with pytest.raises(DataError, match=r"rollout.stratify_by: 1 training task\(s\) have no meta key 'kind' \(first: 't1'\)"):
        strata([_task(0, {"kind": "x"}), _task(1, {})], "kind")
