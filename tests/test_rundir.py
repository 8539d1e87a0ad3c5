"""keel.rundir's readers: the lenient one for a run's own logs, the strict one for inputs."""

from __future__ import annotations

import pytest

from keel.errors import UserError
from keel.rundir import append_jsonl, parse_jsonl, read_jsonl, truncate_jsonl_lines


def test_a_record_holding_a_line_separator_is_one_line(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028 raw; str.splitlines cut such a record in two
    and the reader before this one dropped both halves (and truncate_jsonl_lines with them)."""
    path = tmp_path / "samples.jsonl"
    for step, text in enumerate(["plain", "para\u2028graph", "next\x85line"], 1):
        append_jsonl(path, {"step": step, "text": text})
    assert path.read_bytes().count(b"\n") == 3
    rows, problems = read_jsonl(path)
    assert [r["text"] for r in rows] == ["plain", "para\u2028graph", "next\x85line"] and problems == []
    truncate_jsonl_lines(path, 2)
    assert [r["step"] for r in read_jsonl(path)[0]] == [1, 2]
    assert read_jsonl(tmp_path / "missing.jsonl") == ([], [])


@pytest.mark.parametrize("line, message", [
    ("{oops", r"in.jsonl:2: not valid JSON \(Expecting property name"),
    ("[" * 100_000 + "]" * 100_000, r"in.jsonl:2: not valid JSON \(nested too deeply\)"),
])
def test_strict_reading_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "in.jsonl"
    with pytest.raises(UserError, match=message):
        list(parse_jsonl(['{"id": 1}', line], path))
    # blank lines are skipped but counted; what a record must be (here a list) is the caller's to say
    assert list(parse_jsonl(['{"id": 1}', "", " [2] "], path)) == [(1, {"id": 1}), (3, [2])]
