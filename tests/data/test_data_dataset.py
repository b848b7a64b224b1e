"""Reading prompt files: good rows, bad rows with line numbers, chat prompts, parquet."""

import json
import logging

import pytest

from rlloom.cli import main
from rlloom.data.dataset import DataError, load_prompt_file


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_string_and_chat_prompts_with_metadata(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = write_lines(
        tmp_path / "d.jsonl",
        [
            json.dumps({"question": "What is 1+1?", "solution": 2, "source": "toy"}),
            "",
            json.dumps({"question": chat, "solution": "4"}),
            json.dumps({"question": "Count", "solution": {"numbers": [1, 2], "target": 3}}),
        ],
    )
    rows = load_prompt_file(path, prompt_key="question", answer_key="solution")
    assert [r.index for r in rows] == [0, 1, 2]
    assert rows[0].prompt == "What is 1+1?" and rows[0].ground_truth == "2"
    assert rows[0].metadata == {
        "question": "What is 1+1?",
        "solution": 2,
        "source": "toy",
    }  # as the row has it
    assert rows[1].prompt == chat and rows[1].ground_truth == "4"
    assert json.loads(rows[2].ground_truth) == {"numbers": [1, 2], "target": 3}


def test_bad_rows_are_skipped_and_reported_once_with_line_numbers(tmp_path, caplog):
    path = write_lines(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "ok 1", "answer": "1"}),
            "{not json",
            json.dumps({"prompt": "no answer"}),
            json.dumps({"prompt": "null answer", "answer": None}),
            json.dumps({"answer": "no prompt"}),
            json.dumps({"prompt": [{"role": "user"}], "answer": "1"}),
            json.dumps(["a", "list"]),
            json.dumps({"prompt": "", "answer": "1"}),
            json.dumps({"prompt": "ok 2", "answer": 2}),
        ],
    )
    with caplog.at_level(logging.WARNING, logger="rlloom.data.dataset"):
        rows = load_prompt_file(path)
        assert load_prompt_file(path) == rows  # a run reads the file more than once; one warning
    assert [r.prompt for r in rows] == ["ok 1", "ok 2"]
    assert [r.index for r in rows] == [0, 8]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "skipped 7 of 9 rows" in warnings[0]
    for line in (2, 3, 4, 5, 6):
        assert f"line {line}:" in warnings[0]
    assert "line 3: missing answer field 'answer'" in warnings[0]
    assert "line 4: answer field 'answer' is null" in warnings[0]  # not "missing", as it said
    assert "malformed JSON" in warnings[0] and "2 more" in warnings[0]


def test_all_rows_bad_raises_listing_line_numbers(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl", [json.dumps({"q": "x"}), "oops", json.dumps({"q": "y", "answer": 1})]
    )
    with pytest.raises(ValueError) as err:
        load_prompt_file(path)
    message = str(err.value)
    assert "all 3 rows" in message and "line 1:" in message and "line 2:" in message
    assert "data.prompt_key='prompt'" in message


def test_missing_or_empty_file_raises(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        load_prompt_file(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no rows"):
        load_prompt_file(write_lines(tmp_path / "e.jsonl", [""]))


def test_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(DataError, match=r"pip install rlloom\[parquet\]"):
            load_prompt_file(path)
        return
    pq.write_table(pa.table({"prompt": ["a", None, "c"], "answer": ["1", "2", None]}), path)
    rows = load_prompt_file(path)
    assert [(r.prompt, r.ground_truth, r.index) for r in rows] == [("a", "1", 0)]


def test_non_utf8_and_deeply_nested_lines_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    good = json.dumps({"prompt": "ok", "answer": "1"}).encode()
    path.write_bytes(
        b"\n".join([good, b'{"prompt": "caf\xe9", "answer": "1"}', b"[" * 200_000, good]) + b"\n"
    )
    with caplog.at_level(logging.WARNING, logger="rlloom.data.dataset"):
        rows = load_prompt_file(path)
    assert [r.index for r in rows] == [0, 3]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "skipped 2 of 4 rows" in warning
    assert "line 2: not UTF-8 text (byte 0xe9" in warning and "line 3: JSON nested too deeply" in warning


def test_file_without_usable_rows_is_one_data_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xff\xfe\n" + b"[" * 200_000 + b"\n")
    with pytest.raises(DataError, match=r"all 2 rows are unusable.*line 1: not UTF-8.*line 2: JSON nested"):
        load_prompt_file(path)


def test_truncated_parquet_is_a_data_error(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a"] * 100, "answer": ["1"] * 100}), path)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_prompt_file(path)


def test_a_file_is_parsed_once_until_it_changes(tmp_path, monkeypatch):
    """A run reads its file for the start-up check and for each split: one parse, unless the file
    (its size or modification time) or the keys change."""
    import rlloom.data.dataset as dataset

    parses = []
    jsonl_rows = dataset._jsonl_rows
    monkeypatch.setattr(dataset, "_jsonl_rows", lambda path: parses.append(path) or jsonl_rows(path))
    path = write_lines(
        tmp_path / "d.jsonl", [json.dumps({"prompt": f"p{i}", "q": str(i), "answer": "1"}) for i in range(3)]
    )
    first = load_prompt_file(path)
    first.pop()  # the caller's list is its own
    assert len(load_prompt_file(path)) == 3 and len(parses) == 1
    load_prompt_file(path, prompt_key="q")
    load_prompt_file(path)
    assert len(parses) == 3
    write_lines(path, [json.dumps({"prompt": "changed", "answer": "2"})])
    assert [r.prompt for r in load_prompt_file(path)] == ["changed"] and len(parses) == 4


def test_rows_with_an_empty_answer_are_skipped_and_counted_in_rlloom_eval(
    tiny_checkpoint, tmp_path, capsys, caplog
):
    """An empty or blank answer was kept, and the math reward scored an empty `\\boxed{}` 1.0 on it."""
    rows = [
        {"prompt": "1+1?", "answer": "2"},
        {"prompt": "a?", "answer": ""},
        {"prompt": "b?", "answer": "  "},
    ]
    rows.append({"prompt": "2+2?", "answer": 4})
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    with caplog.at_level(logging.WARNING, logger="rlloom.data.dataset"):
        assert main(["eval", str(tiny_checkpoint), str(path), "rollout.max_new_tokens=2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompts"] == 2  # was 4
    warnings = [r.getMessage() for r in caplog.records]
    assert (
        len(warnings) == 1
        and "skipped 2 of 4 rows: line 2: answer field 'answer' is empty; line 3:" in warnings[0]
    )
