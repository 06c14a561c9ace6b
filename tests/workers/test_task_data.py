"""Data files of a task (workers.tasks.data): the same rows as JSONL, as Parquet (written by
pyarrow) and as a directory saved by the real ``datasets`` library read back alike; chat rows
become prompts through the chat template; a second file holds the validation rows; bad rows and
directories are refused naming the file, the row and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rljob import parse_spec
from tests.workers.models.test_tokenizer import chat_tokenizer_dir
from workers.models.tokenizer import build_tokenizer
from workers.tasks import Task
from workers.tasks.data import DataError, read_rows

ROWS: list[dict[str, Any]] = [
    {"question": "a", "answer": "7", "level": 1, "tags": ["x"]},
    {"question": "b", "answer": "8", "level": 2, "tags": ["y", "z"]},
    {"question": "a b", "answer": "9", "level": 3, "tags": []},
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_saved(path: Path, rows: list[dict[str, Any]]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize(
    "writer", [write_jsonl, write_parquet, write_saved], ids=["jsonl", "parquet", "saved"]
)
def test_every_format_reads_the_same_rows(tmp_path: Path, writer: Any) -> None:
    suffix = {"write_jsonl": ".jsonl", "write_parquet": ".parquet", "write_saved": ""}[writer.__name__]
    path = writer(tmp_path / f"rows{suffix}", ROWS)
    assert [row for _, row in read_rows(path)] == ROWS
    task = Task(parse_spec({"task": {"dataset": str(path)}}).task)
    problems = task.problems()
    assert [(p.question, p.answer, p.entry["level"]) for p in problems] == [
        ("a", "7", 1),
        ("b", "8", 2),
        ("a b", "9", 3),
    ]


def test_a_saved_dataset_dict_names_its_splits(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(
        DataError, match=r"holds several splits \(train\); give one split's directory, e\.g\. .*dd/train"
    ):
        read_rows(tmp_path / "dd")
    assert len(read_rows(tmp_path / "dd" / "train")) == 3


def test_a_directory_that_is_not_a_saved_dataset_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="not a dataset saved with datasets' save_to_disk"):
        read_rows(tmp_path / "d")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="is not a Parquet file"):
        read_rows(tmp_path / "bad.parquet")


def chat_rows(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"messages": [{"role": "user", "content": "a b"}], "answer": "7"},
            # a system message of its own, and the reference as the final assistant turn
            {
                "messages": [
                    {"role": "system", "content": "b"},
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "7"},
                ],
                "answer": "7",
            },
        ],
    )


def test_chat_rows_are_prompted_through_the_chat_template(tmp_path: Path) -> None:
    """The test template: "<|role|> content <|end|> " per message, then "<|assistant|> "."""
    tok_dir = chat_tokenizer_dir(tmp_path / "tok")
    spec = parse_spec(
        {
            "tokenizer": {"kind": "huggingface", "name": tok_dir},
            "task": {"dataset": str(chat_rows(tmp_path)), "chat_template": True, "system_prompt": "?"},
        }
    )
    task = Task.for_job(spec, build_tokenizer(spec))
    first, second = task.problems()
    assert first.question == "a b" and second.question == "a"
    # task.system_prompt goes before a conversation without a system message of its own
    assert task.prompt(first) == "<s><|system|> ? <|end|> <|user|> a b <|end|> <|assistant|> "
    # the final assistant turn is not part of the prompt; the row's system message stays
    assert task.prompt(second) == "<s><|system|> b <|end|> <|user|> a <|end|> <|assistant|> "
    assert second.entry["messages"][-1] == {"role": "assistant", "content": "7"}  # graders still see it


def test_chat_rows_without_a_chat_template_are_refused(tmp_path: Path) -> None:
    spec = parse_spec({"task": {"dataset": str(chat_rows(tmp_path))}})
    with pytest.raises(ValueError, match=r"its rows are chat messages.*set task\.chat_template: true"):
        Task(spec.task)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\] must be \{role: system\|user"),
        ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\] must be"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "messages hold no user message before the"),
    ],
)
def test_a_bad_chat_row_is_refused_with_its_line(tmp_path: Path, row: dict[str, Any], message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], row])
    with pytest.raises(DataError, match=r"^task\.dataset: .*bad\.jsonl:2: " + message):
        Task(parse_spec({"task": {"dataset": str(path), "chat_template": False}}).task)


def test_rows_without_answers_suit_graders_that_read_other_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", [{"question": "q", "target": 3}])
    with pytest.raises(DataError, match=r"rows\.jsonl:1: answer is null, not a string or a number"):
        Task(parse_spec({"task": {"dataset": str(path)}}).task)
    task = Task(
        parse_spec(
            {"task": {"dataset": str(path), "grader": {"type": "numeric", "reference": "{{item.target}}"}}}
        ).task
    )
    [p] = task.problems()
    assert task.grade("it is 3", p).reward == 1.0 and task.grade("4", p).reward == 0.0


def test_validation_rows_come_from_their_own_file(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held = write_parquet(
        tmp_path / "held.parquet", [{"question": "b", "answer": "8"}, {"question": "c", "answer": "1"}]
    )
    spec = parse_spec(
        {
            "task": {"dataset": str(train), "validation_dataset": str(held)},
            "validation": {"interval": 1, "size": 1},
        }
    )
    task = Task.for_job(spec)
    # the first validation.size rows of the second file; training drops the row asking the same question
    assert [p.question for p in task.validation_problems()] == ["b"]
    assert sorted(p.question for p in task.sample(1, 2, 0)) == ["a", "a b"]
    too_many = spec.model_copy(update={"validation": spec.validation.model_copy(update={"size": 3})})
    with pytest.raises(
        ValueError, match=r"task\.validation_dataset .* has 2; set validation\.size to at most 2"
    ):
        Task.for_job(too_many)
