"""A task's data files (``task.dataset``, ``task.validation_dataset``): rows as dicts.

Formats, chosen by the path:

- a directory: a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (its ``state.json``
  lists Arrow stream files, read here with pyarrow; no ``datasets`` install needed). A
  ``DatasetDict`` directory is refused, naming its splits: give the split's own directory;
- ``*.parquet``: a Parquet file;
- anything else: JSONL, one JSON object a line (blank lines skipped).

A row has ``question`` (a string or number: the prompt's text, put into ``task.prompt_template``)
or ``messages`` (a chat, ``[{role, content}, ...]``: the prompt is the conversation up to the
assistant's turn, through the tokenizer's chat template; a final assistant message is not part of
the prompt), plus any fields the graders read (``answer`` for the default grader). At most
:data:`MAX_ROWS` rows a file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_ROWS = 1_000_000
ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A data file or row the task cannot use; the message names the file, the row and the fix."""


Located = list[tuple[str, dict[str, Any]]]  # (where: "file:line" or "file: row N", the row)


def read_rows(path: Path, field: str = "task.dataset") -> Located:
    """The rows of ``path`` (module docstring), each with where it stands for messages (a JSONL
    row's line as an editor counts it); ``field`` names the spec field in errors."""
    if path.is_dir():
        rows = _numbered(path, _saved_dataset(path, field))
    elif not path.is_file():
        raise DataError(f"{field}: {path} does not exist")
    elif path.suffix == ".parquet":
        rows = _numbered(path, _parquet(path, field))
    else:
        rows = _jsonl(path, field)
    if not rows:
        raise DataError(f"{field}: {path} has no problems")
    return rows


def _numbered(path: Path, rows: list[dict[str, Any]]) -> Located:
    return [(f"{path}: row {i + 1}", row) for i, row in enumerate(rows)]


def _jsonl(path: Path, field: str) -> Located:
    rows: Located = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{field}: {path}:{lineno}: expected a JSON object, not JSON ({err})"
                ) from None
            if not isinstance(row, dict):
                raise DataError(
                    f"{field}: {path}:{lineno}: expected a JSON object with question (or messages) and the "
                    f"fields the graders read, got {json.dumps(row)[:200]}"
                )
            rows.append((f"{path}:{lineno}", row))
            if len(rows) > MAX_ROWS:
                raise DataError(f"{field}: {path} has more than {MAX_ROWS} rows")
    return rows


def _parquet(path: Path, field: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"{field}: {path} is not a Parquet file ({err})") from None
    if meta.num_rows > MAX_ROWS:
        raise DataError(f"{field}: {path} has {meta.num_rows} rows; at most {MAX_ROWS}")
    rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    return rows


def _saved_dataset(path: Path, field: str) -> list[dict[str, Any]]:
    import pyarrow as pa

    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(
            f"{field}: {path} holds several splits ({', '.join(splits)}); give one split's directory, "
            f"e.g. {path / (splits[0] if splits else 'train')}"
        )
    state = path / "state.json"
    if not state.is_file():
        raise DataError(
            f"{field}: {path} is a directory but not a dataset saved with datasets' save_to_disk "
            "(no state.json); give a .jsonl or .parquet file, or such a directory"
        )
    files = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    rows: list[dict[str, Any]] = []
    for name in files:
        arrow = (path / name).resolve()
        if arrow.parent != path.resolve():
            raise DataError(f"{field}: {path}/state.json names a file outside the directory: {name!r}")
        with pa.memory_map(str(arrow)) as source:
            table = pa.ipc.open_stream(source).read_all()
        if len(rows) + table.num_rows > MAX_ROWS:
            raise DataError(f"{field}: {path} has more than {MAX_ROWS} rows")
        rows += table.to_pylist()
    return rows


def row_prompt(row: dict[str, Any], where: str) -> tuple[str, list[dict[str, str]] | None]:
    """(the row's question text, its chat messages up to the assistant's turn or None).

    The question of a chat row is its last user message (hold-out and reports compare rows by it).
    ``where`` names the row in errors (``file:line``)."""
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: messages must be a non-empty list of {{role, content}}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                roles = "|".join(ROLES)
                raise DataError(
                    f"{where}: messages[{i}] must be {{role: {roles}, content: <text>}}, got {m!r:.200}"
                )
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        users = [m["content"] for m in messages if m["role"] == "user"]
        if not users:
            raise DataError(f"{where}: messages hold no user message before the assistant's turn")
        return users[-1], [{"role": m["role"], "content": m["content"]} for m in messages]
    question = row.get("question")
    if isinstance(question, bool) or not isinstance(question, str | int | float):
        # str() would make null "None" and an object its Python repr: no prompt anyone means
        raise DataError(
            f"{where}: question is {json.dumps(question)}, not a string or a number (or give chat messages)"
        )
    return str(question), None
