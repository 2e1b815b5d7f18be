import json

import pytest

from isotrain.data.sources import read_rows
from isotrain.errors import DataError


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_malformed_rows_are_skipped_with_their_line_numbers(tmp_path):
    path = write_lines(
        tmp_path / "data.jsonl",
        [
            json.dumps({"prompt": "1+1=", "completion": "2"}),  # 1
            '{"prompt": "2+2=", "completion": ',  # 2 bad JSON
            json.dumps({"prompt": "3+3="}),  # 3 missing completion
            json.dumps({"prompt": 4, "completion": "8"}),  # 4 wrong type
            "",  # 5 blank: not a row
            json.dumps({"prompt": "", "completion": "5"}),  # 6 empty prompt is fine
            json.dumps([1, 2]),  # 7 not an object
            json.dumps({"prompt": "x", "completion": ""}),  # 8 empty completion
        ],
    )
    result = read_rows(path, "prompt_completion")
    assert result.row_ids == [1, 6]
    assert [row["completion"] for row in result.rows] == ["2", "5"]
    assert [line for line, _ in result.skipped] == [2, 3, 4, 7, 8]
    reasons = dict(result.skipped)
    assert reasons[2].startswith("invalid JSON")
    assert reasons[3] == "missing 'completion'"
    assert reasons[4] == "'prompt' must be a string, not int"
    assert reasons[7] == "row is a list, not an object"
    assert reasons[8] == "'completion' is empty"
    assert result.num_rows_read == 7


def test_chat_rows_are_validated(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = write_lines(
        tmp_path / "chat.jsonl",
        [
            json.dumps(good),
            json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
            json.dumps({"messages": [{"role": "bot", "content": "hi"}]}),
            json.dumps({"messages": [{"role": "assistant", "content": 3}]}),
            json.dumps({"messages": []}),
        ],
    )
    result = read_rows(path, "chat")
    assert result.row_ids == [1]
    assert result.skipped == [
        (2, "no assistant turn to train on"),
        (3, "messages[0].role is 'bot'; use one of system, user, assistant"),
        (4, "messages[0].content must be a string"),
        (5, "'messages' must be a non-empty list of {role, content} objects"),
    ]


def test_no_valid_row_is_an_error_naming_file_count_and_first_reason(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [json.dumps({"txt": "a"}), "not json"])
    with pytest.raises(DataError) as err:
        read_rows(path, "text")
    assert str(err.value) == (
        f"data.path '{path}' has no valid 'text' rows: all 2 rows were skipped "
        "(first: line 1: missing 'text'); fix the rows or set data.format to match the file"
    )


def test_missing_file_and_unsupported_extension_messages(tmp_path):
    missing = str(tmp_path / "x.jsonl")
    with pytest.raises(DataError, match=rf"^data.path '{missing}' does not exist; point data.path at a .jsonl"):
        read_rows(missing, "text")
    csv = tmp_path / "data.csv"
    csv.write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"unsupported extension '.csv'; use a .jsonl, .jsonl.gz, .json or .parquet file, a glob"):
        read_rows(str(csv), "text")


def test_json_list_file(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": ""}, {"text": "b"}]))
    result = read_rows(str(path), "text")
    assert [row["text"] for row in result.rows] == ["a", "b"]
    assert result.row_ids == [1, 3] and result.skipped == [(2, "'text' is empty")]
    path.write_text(json.dumps({"text": "a"}))
    with pytest.raises(DataError, match="holds a JSON dict, not a list of rows"):
        read_rows(str(path), "text")


def test_parquet_file(tmp_path):
    import pyarrow
    import pyarrow.parquet

    table = pyarrow.table({"prompt": ["1+1=", "2+2=", "3+3="], "completion": ["2", None, "6"]})
    path = tmp_path / "data.parquet"
    pyarrow.parquet.write_table(table, path)
    result = read_rows(str(path), "prompt_completion")
    assert [row["completion"] for row in result.rows] == ["2", "6"]
    assert result.row_ids == [1, 3]
    assert result.skipped == [(2, "missing 'completion'")] and result.unit == "row"


def test_saved_dataset_directory(tmp_path):
    import datasets

    rows = [{"text": "one"}, {"text": "two"}, {"text": ""}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "plain"))
    result = read_rows(str(tmp_path / "plain"), "text")
    assert [row["text"] for row in result.rows] == ["one", "two"]
    assert result.skipped == [(3, "'text' is empty")]

    train, test = datasets.Dataset.from_list(rows[:1]), datasets.Dataset.from_list(rows[1:2])
    splits = datasets.DatasetDict({"train": train, "test": test})
    splits.save_to_disk(str(tmp_path / "splits"))
    assert [row["text"] for row in read_rows(str(tmp_path / "splits"), "text").rows] == ["one"]

    (tmp_path / "not_a_dataset").mkdir()
    with pytest.raises(DataError, match="is a directory but not a dataset saved with save_to_disk"):
        read_rows(str(tmp_path / "not_a_dataset"), "text")
