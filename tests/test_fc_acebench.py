"""ACEBench loader and scorer: oracle 100% on the real sample and on synthetic items in the same
format, hand-checked rule cases, the weighted overall, and loader errors."""

from __future__ import annotations

import json

import pytest

from keel.fc.acebench import (
    DEFAULT_DATA_DIR,
    IRRELEVANT_ANSWER,
    acebench_overall,
    category_accuracies,
    check_special,
    load_acebench,
    score_answer,
    write_acebench_dir,
)
from keel.fc.evaluate import evaluate_fc
from keel.fc.parse import parse_calls

pytestmark = pytest.mark.skipif(not DEFAULT_DATA_DIR.is_dir(), reason="ACEBench sample not present")


def test_sample_loads_normal_and_special_only():
    tasks = load_acebench()
    # 17 files x 5 items, minus the 2 agent files = 75 items.
    assert len(tasks) == 75
    assert not any(t.kind.startswith("agent") for t in tasks)
    t = next(t for t in tasks if t.id == "normal_single_turn_parallel_function_2")
    # ACEBench keys repeated calls Api_1, Api_2...; the gold names the real API.
    assert {c["name"] for c in t.gold_turns[0]} == {"market_insight_predict_trends"} and len(t.gold_turns[0]) == 4


@pytest.mark.parametrize("fmt", ["json", "python"])
def test_oracle_100_null_0_on_sample(tmp_path, fmt):
    s = evaluate_fc("acebench", "oracle", out_dir=tmp_path, call_formats=(fmt,))
    assert s["overall/normal"] == 1.0 and s["overall/special"] == 1.0
    # agent not run: 0.2676 * 1 + 0.578 * 1 + 0.1545 * 0 = 0.8456; renormalised = 1.0
    assert s["overall/acebench"] == pytest.approx(0.8456) and s["overall/acebench_no_agent"] == pytest.approx(1.0)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 75
    n = evaluate_fc("acebench", "null", call_formats=(fmt,))
    assert n["overall/normal"] == 0.0 and n["overall/special"] == 0.0


def _fn(name, props, required):
    return {"name": name, "description": "", "parameters": {"type": "dict", "properties": props, "required": required}}


def _synthetic(tmp_path):
    book = _fn("book_hotel", {"city": {"type": "string"}, "nights": {"type": "integer"}, "guests": {"type": "array", "items": {"type": "object"}}}, ["city", "nights"])
    items = {
        "normal_atom_number": [
            ({"id": "normal_atom_number_0", "question": "user: Book Paris for 3 nights.\n", "function": [book]}, {"book_hotel": {"city": "Paris", "nights": 3}}),
            ({"id": "normal_atom_number_1", "question": "user: Book Rome, 2 nights, Ann and Bo.\n", "function": [book]},
             {"book_hotel": {"city": "Rome", "nights": 2, "guests": [{"name": "Ann"}, {"name": "Bo"}]}}),
        ],
        "normal_multi_turn_user_adjust": [
            ({"id": "normal_multi_turn_user_adjust_0_0", "question": "user: Paris, 1 night\n", "function": [book]}, {"book_hotel": {"city": "Paris", "nights": 1}}),
            ({"id": "normal_multi_turn_user_adjust_0_1", "question": "user: make it 2\n", "function": [book]}, {"book_hotel": {"city": "Paris", "nights": 2}}),
            ({"id": "normal_multi_turn_user_adjust_1_0", "question": "user: Oslo 4\n", "function": [book]}, {"book_hotel": {"city": "Oslo", "nights": 4}}),
        ],
        "special_incomplete": [({"id": "special_incomplete_0", "question": "user: Book a hotel.", "function": [book]}, {"book_hotel": ["city", "nights"]})],
        "special_error_param": [({"id": "special_error_param_0", "question": "user: Book Paris for -2 nights.", "function": [book]}, {"nights": ["-2"]})],
        "special_irrelevant": [({"id": "special_irrelevant_0", "question": "user: What is the weather?", "function": [book]}, IRRELEVANT_ANSWER)],
    }
    return write_acebench_dir(items, tmp_path / "ace")


def test_synthetic_oracle_is_100(tmp_path):
    root = _synthetic(tmp_path)
    s = evaluate_fc("acebench", "oracle", data=str(root), call_formats=("json", "python"))
    assert s["overall/normal"] == s["overall/special"] == 1.0
    assert s["format_ood/python/overall/normal"] == 1.0


def test_rules_by_hand(tmp_path):
    tasks = {t.id: t for t in load_acebench(_synthetic(tmp_path))}
    t = tasks["normal_atom_number_0"]
    ok = lambda text: score_answer(t, text, parse_calls(text, "python"))[0]  # noqa: E731
    assert ok("[book_hotel(city='paris', nights=3)]")  # strings compare standardised (case)
    assert ok("[book_hotel(city='Paris, France', nights=3)]")  # gold is a substring of the value
    assert not ok("[book_hotel(city='Paris', nights=3.5)]")
    assert not ok("[book_hotel(city='Paris')]")  # required parameter missing
    assert not ok("[book_hotel(city='Paris', nights=3, guests=[])]")  # parameter not in the answer
    assert not ok("[book_hotel(city='Paris', nights=3), book_hotel(city='Paris', nights=3)]")  # call count
    assert not ok("Sure, booked.")
    t1 = tasks["normal_atom_number_1"]
    assert score_answer(t1, "", parse_calls("[book_hotel(city='Rome', nights=2, guests=[{'name': 'ann'}, {'name': 'Bo'}])]", "python"))[0]
    assert not score_answer(t1, "", parse_calls("[book_hotel(city='Rome', nights=2, guests=[{'name': 'Bo'}])]", "python"))[0]
    # special: the phrase and every name / value must appear
    assert check_special("special_incomplete", {"book_hotel": ["city", "nights"]}, "Missing necessary parameters (city, nights) for the api (book_hotel)") == (True, None)
    assert check_special("special_incomplete", {"book_hotel": ["city", "nights"]}, "Missing necessary parameters (city) for the api (book_hotel)") == (False, "error_correction")
    assert check_special("special_error_param", {"nights": ["-2"]}, "There is incorrect value (2)") == (False, "error_correction")
    assert check_special("special_irrelevant", None, "I can't.") == (False, "error_detection")
    special = tasks["special_irrelevant_0"]
    assert score_answer(special, "[book_hotel(city='x', nights=1)]", parse_calls("[book_hotel(city='x', nights=1)]", "python")) == (False, "called_a_function")


def test_multi_turn_counts_whole_conversations():
    rows = [
        {"id": "normal_multi_turn_user_adjust_0_0", "category": "normal_multi_turn_user_adjust", "valid": True},
        {"id": "normal_multi_turn_user_adjust_0_1", "category": "normal_multi_turn_user_adjust", "valid": False},
        {"id": "normal_multi_turn_user_adjust_1_0", "category": "normal_multi_turn_user_adjust", "valid": True},
        {"id": "normal_atom_bool_0", "category": "normal_atom_bool", "valid": True},
    ]
    acc, counts = category_accuracies(rows)
    # conversation 0 has a failed item, conversation 1 passes: 1 / 2
    assert acc == {"normal_multi_turn_user_adjust": 0.5, "normal_atom_bool": 1.0}
    assert counts == {"normal_multi_turn_user_adjust": 3, "normal_atom_bool": 1}


def test_weighted_overall_by_hand():
    acc = {"normal_atom_bool": 0.5, "normal_preference": 1.0, "special_irrelevant": 1.0}
    counts = {"normal_atom_bool": 10, "normal_preference": 30, "special_irrelevant": 5}
    out = acebench_overall(acc, counts)
    # normal = (0.5*10 + 1.0*30) / 40 = 0.875; overall = 0.2676*1 + 0.578*0.875 = 0.77335
    assert out["overall/normal"] == pytest.approx(0.875)
    assert out["overall/acebench"] == pytest.approx(0.77335)
    assert out["overall/acebench_no_agent"] == pytest.approx(0.77335 / 0.8456)


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="ACEBench data directory not found"):
        load_acebench(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no data_<category>.json files"):
        load_acebench(tmp_path / "empty")
    with pytest.raises(ValueError, match="needs ACEBench's sandbox"):
        load_acebench(categories=["agent_multi_turn"])
    root = _synthetic(tmp_path)
    (root / "data_normal_atom_number.json").write_text('{"id": "x", "question": "q", "function": []}\nnot json\n')
    with pytest.raises(ValueError, match=r"data_normal_atom_number.json:2: not valid JSON"):
        load_acebench(root, categories=["normal_atom_number"])
    (root / "data_normal_atom_number.json").write_text(json.dumps({"id": "zzz", "question": "q", "function": []}) + "\n")
    with pytest.raises(ValueError, match="no answer for zzz"):
        load_acebench(root, categories=["normal_atom_number"])
