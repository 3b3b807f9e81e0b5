"""Reading files: a data file -> rows of named cells, read as text. No tokenizer, no torch, no format names.

The first stage of :mod:`scale.data`. Which columns a format needs and how its rows are checked is
:mod:`scale.data.tasks` (one module per format); this module reads the file and offers the cell checks the
formats share, and :class:`DataError`, the one error every stage raises for bad data.

Files are read with the standard library, every cell as the text it is: a CSV cell ``NA`` or ``None`` stays
that string (no missing-value guessing), ``.tsv`` has no quoting (a ``"`` is a character), and a ``.csv``
record must sit on one physical line, so a stray quote cannot swallow the following lines unnoticed.
Rows are numbered from 0 in file order (the header is not a row); errors name the row and, for a line-based
file, the line an editor shows it on (:func:`with_line`: ``row 20 (line 21)``).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import re
import sys
import unicodedata
from pathlib import Path
from typing import Any

from scale.config.schema import DataConfig

EXTENSIONS = (".csv", ".json", ".jsonl", ".tsv")


class DataError(ValueError):
    """The data file or its rows cannot be used; the message names the field and the fix."""


class FileRows(list):
    """A source's rows (dicts, numbered from 0) and where each one is in its file(s), for error messages.

    Attributes:
        lines: the 1-based line of each row (``lines[i]`` for row ``i``) in a line-based file (.jsonl, .csv,
            .tsv); ``None`` where rows have no line (a JSON array, Parquet, a hub data set).
        files: ``[(first row, file name)]`` of the shards the rows came from (a directory or glob); ``[]`` for
            one file.
    """

    lines: list[int] | None = None
    files: list[tuple[int, str]] = []


def row_line(rows: Any, i: int) -> str | None:
    """Where row ``i`` of ``rows`` (a :class:`FileRows`) is, as an editor shows it: ``line 21`` or ``line 3 of
    part-01.jsonl``; ``None`` when the rows have no lines."""
    lines = getattr(rows, "lines", None)
    if not lines or not 0 <= i < len(lines):
        return None
    name = next((n for start, n in reversed(getattr(rows, "files", []) or []) if start <= i), None)
    return f"line {lines[i]}" + (f" of {name}" if name else "")


def with_line(message: str, rows: Any) -> str:
    """``message`` with the editor's line of the row it names after its first ``row N`` (rows count from 0, an
    editor's lines from 1, and a CSV header takes a line): ``row 20 (line 21) of data.jsonl: ...``."""
    m = re.search(r"\brow (\d+)\b(?! \(line)", message)
    where = row_line(rows, int(m.group(1))) if m else None
    return message if where is None else f"{message[:m.end()]} ({where}){message[m.end():]}"


def with_place(message: str, rows: Any, path: str | None) -> str:
    """``message`` with the place of the row it names first: its line (:func:`with_line`) and, unless the message
    names a file there already, ``of <path>``: ``row 3: ...`` -> ``row 3 (line 4) of data.jsonl: ...``. Unchanged
    when it names no row; without ``path`` only the line is added."""
    message = with_line(message, rows)
    m = re.search(r"\brow \d+\b( \([^)]*\))?", message)
    if m is None or path is None or message[m.end():].startswith(" of "):
        return message
    return f"{message[:m.end()]} of {path}{message[m.end():]}"


def read_table(cfg: DataConfig, path: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Read a .jsonl/.json/.csv/.tsv file into rows (dicts) and its column names (:func:`columns_of`).

    Raises:
        DataError: missing, empty or non-UTF-8 file, unknown extension, a line that is not JSON, a row that
            is not an object, a CSV record whose quoting spans several lines, or a row with another number
            of cells than the header.
    """
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise DataError(f"data.path={path!r} {what}; point it at a data file (.jsonl/.json/.csv/.tsv/.parquet/"
                        f".arrow), a directory or glob of shards, a save_to_disk directory or a hub id org/name (a "
                        f"relative path is read from the current directory, {os.getcwd()})")
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
    return rows, columns_of(rows)


def columns_of(rows: list[dict[str, Any]]) -> list[str]:
    """Every column any row has, in the order they first appear: a JSON row may lack a key others have (the format
    is then decided from all of them, and the row check names the row that lacks one)."""
    return list(dict.fromkeys(itertools.chain.from_iterable(rows)))


def _read_json(text: str, path: str) -> list[dict[str, Any]]:
    """A JSON array of objects, or one JSON object per line (blank lines skipped)."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from e
        numbered, lines = list(enumerate(rows)), None
    else:
        numbered, i, lines = [], 0, []
        # Only "\n" ends a JSON line: str.splitlines() would also split at U+2028, U+0085, ... that JSON text
        # may hold raw (json.dumps(ensure_ascii=False) writes them as they are).
        for line_no, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                numbered.append((i, json.loads(line)))
                lines.append(line_no)
            except json.JSONDecodeError as e:
                raise DataError(f"line {line_no} of {path} is not JSON ({e.msg}); write one JSON object per "
                                f"line") from e
            i += 1
    for i, row in numbered:
        if not isinstance(row, dict):
            at = f" (line {lines[i]})" if lines else ""
            raise DataError(f"row {i}{at} of {path} is a {type(row).__name__}, not an object with named columns")
    out = FileRows(row for _, row in numbered)
    out.lines = lines
    return out


def _read_delimited(text: str, path: str, tsv: bool, names: list[str] | None) -> list[dict[str, Any]]:
    """CSV (RFC 4180 quoting) or TSV (no quoting); every cell is a string; one record per physical line."""
    quoting = csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t" if tsv else ",", quoting=quoting,
                        strict=True)
    records, line = [], 0
    # csv refuses a cell over 131,072 characters by default ("field larger than field limit"),
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
    rows = FileRows()
    for i, (line_no, cells) in enumerate(records):
        if len(cells) != len(header):
            raise DataError(f"row {i} of {path} (line {line_no}) has {len(cells)} cells but the header has "
                            f"{len(header)} ({header}); fix the row or its delimiters")
        rows.append(dict(zip(header, cells)))
    rows.lines = [line_no for line_no, _ in records]
    return rows


def normalize_label(label: Any) -> str:
    """A label as text: Unicode NFC form, without surrounding whitespace. The same rule for ``data.labels`` and
    the file, so a label typed in two Unicode normal forms is one class."""
    return unicodedata.normalize("NFC", str(label)).strip()


def row_key(row: dict[str, Any]) -> str:
    """The row's content (everything but its index and its mixture source) as canonical JSON: equal keys are
    exact duplicates."""
    return json.dumps({k: v for k, v in row.items() if k not in ("row", "source")}, sort_keys=True,
                      ensure_ascii=False)


def text_cell(raw: dict[str, Any], column: str, i: int, path: str, strip: bool = True) -> str:
    value = raw.get(column)
    if value is None or isinstance(value, (dict, list)) or not str(value).strip():
        what = "empty" if value is None or not str(value).strip() else f"a {type(value).__name__}, not text, in"
        raise DataError(f"row {i} of {path}: {what} {column!r}")
    return str(value).strip() if strip else str(value)


def integer_cell(value: Any, column: str, i: int, path: str) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DataError(f"row {i} of {path}: data.type_column={column!r} must be an integer, got {value!r}")
    return value


def target_cell(value: Any, column: str, i: int, path: str) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value:
        return value
    raise DataError(f"row {i} of {path}: {column!r} must be a token id (integer >= 0) or the text of one token, "
                    f"got {value!r}")

