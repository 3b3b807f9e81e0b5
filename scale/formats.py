"""Data files -> validated rows of one of four formats. No tokenizer, no torch.

| format | columns | what is trained (the *tail*, see :mod:`scale.data`) |
|---|---|---|
| ``text`` | ``text``, optional ``type``, optional ``target`` | the last ``loss.threshold`` tokens of each row |
| ``classification`` | ``text``, ``label`` (one of ``data.labels``) | the label's tokens + EOS |
| ``prompt_completion`` | ``prompt``, ``completion`` | the completion's tokens + EOS |
| ``messages`` | ``messages`` (list of ``{role, content}``) | the last assistant turn |

The format is ``data.format``, or (``auto``) the first of ``messages``, ``prompt_completion``,
``classification``, ``text`` whose columns the file has. Column names come from ``data.*_column``.

Files are read with the standard library, every cell as the text it is: a CSV cell ``NA`` or ``None`` stays
that string (no missing-value guessing), ``.tsv`` has no quoting (a ``"`` is a character), and a ``.csv``
record must sit on one physical line, so a stray quote cannot swallow the following lines unnoticed.
Rows are numbered from 0 in file order (the header is not a row); errors name the row.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

from scale.config import DataConfig
from scale.sources import read_source

EXTENSIONS = (".csv", ".json", ".jsonl", ".tsv")
FORMATS = ("text", "classification", "prompt_completion", "messages")
ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """The data file or its rows cannot be used; the message names the field and the fix."""


def columns_needed(cfg: DataConfig) -> dict[str, list[str]]:
    """The columns each format needs, in detection order (``messages`` first, ``text`` last)."""
    return {
        "messages": [cfg.messages_column],
        "prompt_completion": [cfg.prompt_column, cfg.completion_column],
        "classification": [cfg.text_column, cfg.label_column],
        "text": [cfg.text_column],
    }


def detect_format(cfg: DataConfig, columns: list[str], path: str) -> str:
    """``data.format``, or the first format whose columns are all in ``columns``.

    ``text`` is the fallback, so it is detected only when no column is left over (besides ``type`` and
    ``target``): a ``text, label`` file with a misspelled ``data.label_column`` is an error, not a text file.

    Raises:
        DataError: no format fits (the message lists every format, the columns it needs and what is
            missing), or the configured format's columns are missing.
    """
    needed = columns_needed(cfg)
    if cfg.format != "auto":
        missing = [c for c in needed[cfg.format] if c not in columns]
        if missing:
            raise DataError(f"data.format={cfg.format} needs the columns {needed[cfg.format]} but {path} has "
                            f"{columns}; rename the columns or set data.*_column (data.column_names for a "
                            f"header-less file)")
        return cfg.format
    optional = {cfg.text_column, cfg.type_column or "type", cfg.target_column}
    for name, cols in needed.items():
        if all(c in columns for c in cols) and (name != "text" or set(columns) <= optional):
            return name
    reasons = []
    for name, cols in needed.items():
        missing = [c for c in cols if c not in columns]
        extra = [c for c in columns if c not in optional] if name == "text" and not missing else []
        why = f"no {', '.join(map(repr, missing))}" if missing else f"other columns {extra}: set data.format=text"
        reasons.append(f"{name} needs {', '.join(cols)}" + (" (+ type, target)" if name == "text" else "") +
                       f" ({why})")
    raise DataError(f"{path} has the columns {columns}, which fit no data format: {'; '.join(reasons)}. Rename "
                    f"the columns, set data.*_column, or set data.format")


def read_table(cfg: DataConfig, path: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Read a .jsonl/.json/.csv/.tsv file into rows (dicts) and its column names.

    Raises:
        DataError: missing, empty or non-UTF-8 file, unknown extension, a line that is not JSON, a row that
            is not an object, a CSV record whose quoting spans several lines, or a row with another number
            of cells than the header.
    """
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise DataError(f"data.path={path!r} {what}; point it at a .jsonl/.json/.csv/.tsv file (a relative path is "
                        f"read from the current directory)")
    suffix = file.suffix.lower()
    if suffix not in EXTENSIONS:
        raise DataError(f"data.path={path!r}: unknown extension {file.suffix!r}; use one of {list(EXTENSIONS)}")
    if file.stat().st_size == 0:
        raise DataError(f"data.path={path!r} is empty; it needs at least one labelled row")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data.path={path!r} is not UTF-8 (byte {e.start}); re-encode it as UTF-8") from e
    text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark is not part of the first column's name
    if cfg.column_names is not None and suffix not in (".csv", ".tsv"):
        raise DataError("data.column_names applies to header-less .csv/.tsv files only; remove it")
    if suffix in (".csv", ".tsv"):
        rows = _read_delimited(text, path, tsv=suffix == ".tsv", names=cfg.column_names)
    else:
        rows = _read_json(text, path)
    if not rows:
        raise DataError(f"data.path={path!r} has no rows")
    columns = list(dict.fromkeys(k for row in rows[:1] for k in row))
    return rows, columns


def _read_json(text: str, path: str) -> list[dict[str, Any]]:
    """A JSON array of objects, or one JSON object per line (blank lines skipped)."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from e
        numbered = list(enumerate(rows))
    else:
        numbered, i = [], 0
        # Only "\n" ends a JSON line: str.splitlines() would also split at U+2028, U+0085, ... that JSON text
        # may hold raw (json.dumps(ensure_ascii=False) writes them as they are).
        for line_no, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                numbered.append((i, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"line {line_no} of {path} is not JSON ({e.msg}); write one JSON object per "
                                f"line") from e
            i += 1
    for i, row in numbered:
        if not isinstance(row, dict):
            raise DataError(f"row {i} of {path} is a {type(row).__name__}, not an object with named columns")
    return [row for _, row in numbered]


def _read_delimited(text: str, path: str, tsv: bool, names: list[str] | None) -> list[dict[str, Any]]:
    """CSV (RFC 4180 quoting) or TSV (no quoting); every cell is a string; one record per physical line."""
    quoting = csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t" if tsv else ",", quoting=quoting,
                        strict=True)
    records, line = [], 0
    # [issue 18] csv refuses a cell over 131,072 characters by default ("field larger than field limit"),
    # which read as an unclosed quote; a cell is as long as the file allows.
    limit = csv.field_size_limit(sys.maxsize)
    try:
        for cells in reader:
            start, line = line + 1, reader.line_num
            if line > start:
                row = len(records) - (names is None)
                raise DataError(
                    f"row {row} of {path} (line {start}) runs on to line {line}: a quoted cell holds "
                    f"{line - start} line break(s), so the lines after it became part of one row. Double a "
                    f"literal quote inside a quoted cell (\"\"), or write the data as .jsonl")
            if cells:  # blank lines are not rows
                records.append((start, cells))
    except csv.Error as e:
        what = "the header" if names is None and not records else f"row {len(records) - (names is None)}"
        raise DataError(f"{what} of {path} (line {line + 1}) cannot be parsed as CSV ({e}): a quote opened in it "
                        f"does not close where its cell ends. Double a literal quote inside a quoted cell (\"\"), "
                        f"or write the data as .jsonl") from e
    finally:
        csv.field_size_limit(limit)
    if names is None:
        if not records:
            raise DataError(f"data.path={path!r} has no rows")
        (_, header), records = records[0], records[1:]
    else:
        header = list(names)
    rows = []
    for i, (line_no, cells) in enumerate(records):
        if len(cells) != len(header):
            raise DataError(f"row {i} of {path} (line {line_no}) has {len(cells)} cells but the header has "
                            f"{len(header)} ({header}); fix the row or its delimiters")
        rows.append(dict(zip(header, cells)))
    return rows


def normalize_label(label: Any) -> str:
    """A label as text without surrounding whitespace: the same rule for ``data.labels`` and the file."""
    return str(label).strip()


def load_rows(cfg: DataConfig, path: str) -> list[dict[str, Any]]:
    """Read the file, detect its format and validate every row.

    Args:
        cfg: the data section (columns, format, labels).
        path: local file (already resolved from an embedded name).

    Returns:
        Rows as dicts with a ``row`` index (file order) and, by format: ``text`` (+ ``type``, ``target``);
        ``text``, ``label`` (+ ``type``); ``prompt``, ``completion`` (+ ``type``); ``messages`` (+ ``type``).

    Raises:
        DataError: see :func:`read_table` and :func:`detect_format`; an empty text/prompt/completion, a
            label outside ``data.labels``, a non-integer type, or a conversation that does not end with an
            assistant turn.
    """
    table, columns = read_source(cfg, path)  # [issue 18] any source: scale.sources (tables: read_table below)
    fmt = detect_format(cfg, columns, path)
    type_column = cfg.type_column or ("type" if fmt == "text" and "type" in columns else None)
    if cfg.type_column is not None and cfg.type_column not in columns:
        raise DataError(f"data.type_column={cfg.type_column!r} is not a column of {path}; its columns are "
                        f"{columns}. Set data.type_column (or data.column_names for a header-less file).")
    target_column = cfg.target_column if fmt == "text" and cfg.target_column in columns else None
    allowed = [normalize_label(x) for x in cfg.labels]
    rows = []
    for i, raw in enumerate(table):
        row: dict[str, Any] = {"row": i}
        if fmt in ("text", "classification"):
            row["text"] = _text(raw, cfg.text_column, i, path)
        if fmt == "classification":
            value = raw.get(cfg.label_column)
            label = normalize_label(value) if value is not None else None
            if label not in allowed:
                raise DataError(f"row {i} of {path}: label {label!r} is not in data.labels={cfg.labels}; "
                                f"fix the row or add the label to data.labels")
            row["label"] = label
        elif fmt == "prompt_completion":
            row["prompt"] = _text(raw, cfg.prompt_column, i, path, strip=False)
            row["completion"] = _text(raw, cfg.completion_column, i, path, strip=False)
        elif fmt == "messages":
            row["messages"] = _messages(raw.get(cfg.messages_column), cfg.messages_column, i, path)
        if type_column is not None:
            row["type"] = _integer(raw.get(type_column), type_column, i, path)
        if target_column is not None:
            row["target"] = _target(raw.get(target_column), target_column, i, path)
        rows.append(row)
    return rows


def row_format(row: dict[str, Any]) -> str:
    """The format of a row returned by :func:`load_rows`."""
    if "messages" in row:
        return "messages"
    if "completion" in row:
        return "prompt_completion"
    return "classification" if "label" in row else "text"


def row_key(row: dict[str, Any]) -> str:
    """The row's content (everything but its index) as canonical JSON: equal keys are exact duplicates."""
    return json.dumps({k: v for k, v in row.items() if k != "row"}, sort_keys=True, ensure_ascii=False)


def _text(raw: dict[str, Any], column: str, i: int, path: str, strip: bool = True) -> str:
    value = raw.get(column)
    if value is None or isinstance(value, (dict, list)) or not str(value).strip():
        what = "empty" if value is None or not str(value).strip() else f"a {type(value).__name__}, not text, in"
        raise DataError(f"row {i} of {path}: {what} {column!r}")
    return str(value).strip() if strip else str(value)


def _integer(value: Any, column: str, i: int, path: str) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DataError(f"row {i} of {path}: data.type_column={column!r} must be an integer, got {value!r}")
    return value


def _target(value: Any, column: str, i: int, path: str) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value:
        return value
    raise DataError(f"row {i} of {path}: {column!r} must be a token id (integer >= 0) or the text of one token, "
                    f"got {value!r}")


def _messages(value: Any, column: str, i: int, path: str) -> list[dict[str, str]]:
    if isinstance(value, str):  # a CSV cell holding JSON
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, list) or not value:
        raise DataError(f"row {i} of {path}: {column!r} must be a non-empty list of {{role, content}} messages, "
                        f"got {type(value).__name__}")
    messages = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise DataError(f"row {i} of {path}: message {j} must be {{'role': one of {list(ROLES)}, 'content': "
                            f"text}}, got {m!r}"[:400])
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"row {i} of {path}: no assistant message; the messages format trains the last "
                        f"assistant turn, so every conversation needs one")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"row {i} of {path}: the last message is from {messages[-1]['role']!r}, not "
                        f"'assistant'; the messages format trains the last assistant turn, so end every "
                        f"conversation with it")
    if not messages[-1]["content"].strip():
        raise DataError(f"row {i} of {path}: the last assistant message is empty")
    return messages
