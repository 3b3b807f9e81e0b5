"""Tasks: the data formats, one module each, and the registry that decides a source's format once (:func:`load_rows`).

| format | columns | what is trained (the *tail*, see :mod:`scale.data.tokenize`) |
|---|---|---|
| ``text`` | ``text``, optional ``type``, optional ``target`` | the last ``loss.threshold`` tokens of each row |
| ``classification`` | ``text``, ``label`` (one of ``data.labels``) | the label's tokens + EOS |
| ``prompt_completion`` | ``prompt``, ``completion`` (text; lists of messages: a chat) | the completion's tokens + EOS |
| ``prompts`` | ``prompt`` (text or messages; or ``data.prompt_template`` over any columns), any others | nothing: the completions ``loss.objective: grpo`` samples |
| ``messages`` | ``messages`` (list of ``{role, content, ...}``), optional ``tools`` | every assistant turn (``data.train_on``) |
| ``preference`` | ``chosen``, ``rejected`` (text; lists of messages), optional ``prompt``, ``tools`` | each side's completion + end-of-turn: a pair is two examples |

The format is ``data.format``, or (``auto``) the first of :data:`TASKS` (in order) whose columns the file has;
the last one is the fallback and is detected only when no column is left over. Column names come from
``data.*_column``. A new format is one module with a :class:`scale.data.tasks.base.Task` and one line here. The
rows :func:`load_rows` returns carry their task (:class:`scale.data.tasks.base.Rows`): no later stage asks again.
"""

from __future__ import annotations

from typing import Any

from scale.config.schema import DataConfig
from scale.data.read import DataError, integer_cell, with_line
from scale.data.sources import read_source
from scale.data.tasks import classification, messages, preference, prompt_completion, prompts, text
from scale.data.tasks.base import Rows, Task

# Detection order: the first whose columns the file has; the last is the fallback.
TASKS: dict[str, type[Task]] = {
    "preference": preference.Preference,
    "messages": messages.Messages,
    "prompt_completion": prompt_completion.PromptCompletion,
    "prompts": prompts.Prompts,
    "classification": classification.Classification,
    "text": text.Text,
}
FORMATS = tuple(reversed(TASKS))  # as data.format lists them
# Formats whose rows may share one mixture (data.datasets) besides one format alone, and the format that
# evaluates it: both train their completions, and eval/exact_match over the trained tail means the same for both.
MIXABLE: dict[frozenset[str], str] = {frozenset({"prompt_completion", "messages"}): "prompt_completion"}


def get(name: str) -> Task:
    """A fresh instance of format ``name``."""
    return TASKS[name]()


def columns_needed(cfg: DataConfig) -> dict[str, list[str]]:
    """The columns each format needs, in detection order."""
    return {name: task().columns(cfg) for name, task in TASKS.items()}


def detect_format(cfg: DataConfig, columns: list[str], path: str) -> str:
    """``data.format``, or the first format whose columns are all in ``columns``.

    The fallback (last) format is detected only when no column is left over besides its optional ones: a
    ``text, label`` file with a misspelled ``data.label_column`` is an error, not a text file.

    Raises:
        DataError: no format fits (the message lists every format, the columns it needs and what is
            missing), or the configured format's columns are missing.
    """
    needed = columns_needed(cfg)
    fallback = list(TASKS)[-1]
    if cfg.format != "auto":
        missing = [c for c in needed[cfg.format] if c not in columns]
        if missing:
            raise DataError(f"data.format={cfg.format} needs the columns {needed[cfg.format]} but {path} has "
                            f"{columns}; rename the columns or set data.*_column (data.column_names for a "
                            f"header-less file)")
        return cfg.format
    extra_cols = get(fallback).optional_columns(cfg)
    optional = set(needed[fallback]) | set(extra_cols)
    for name, cols in needed.items():
        if all(c in columns for c in cols) and (name != fallback or set(columns) <= optional):
            return name
    reasons = []
    for name, cols in needed.items():
        missing = [c for c in cols if c not in columns]
        extra = [c for c in columns if c not in optional] if name == fallback and not missing else []
        why = f"no {', '.join(map(repr, missing))}" if missing else f"other columns {extra}: set data.format={name}"
        plus = f" (+ {', '.join(extra_cols)})" if name == fallback else ""
        reasons.append(f"{name} needs {', '.join(cols)}" + plus + f" ({why})")
    raise DataError(f"{path} has the columns {columns}, which fit no data format: {'; '.join(reasons)}. Rename "
                    f"the columns, set data.*_column, or set data.format")


def load_rows(cfg: DataConfig, path: str) -> Rows:
    """Read a source, decide its format once and check every row (:meth:`Task.read`).

    Args:
        cfg: the data section (columns, format, labels).
        path: a file, directory, glob or hub id (:mod:`scale.data.sources`; already resolved from an embedded name).

    Returns:
        Rows as dicts with a ``row`` index (file order), the format's fields (``text`` (+ ``target``); ``text``,
        ``label``; ``prompt``, ``completion``; ``messages`` (+ ``tools``)) and ``type`` when there is a type column;
        ``.task`` is the format's task that encodes them, ``.lines``/``.files`` where each row is in a line-based
        file (:func:`scale.data.read.row_line`).

    Raises:
        DataError: see :func:`scale.data.sources.read_source`, :func:`detect_format` and the format's row checks; a
            non-integer type.
    """
    table, columns = read_source(cfg, path)  # any source (tables: scale.data.read.read_table)
    fmt = detect_format(cfg, columns, path)
    task = get(fmt)
    type_column = cfg.type_column or ("type" if "type" in task.optional_columns(cfg) and "type" in columns else None)
    if cfg.type_column is not None and cfg.type_column not in columns:
        raise DataError(f"data.type_column={cfg.type_column!r} is not a column of {path}; its columns are "
                        f"{columns}. Set data.type_column (or data.column_names for a header-less file).")
    rows = []
    for i, raw in enumerate(table):
        try:
            row: dict[str, Any] = {"row": i, **task.read(raw, cfg, i, path)}
            if type_column is not None:
                row["type"] = integer_cell(raw.get(type_column), type_column, i, path)
        except DataError as e:  # name the line an editor shows the row on
            raise DataError(with_line(str(e), table)) from None
        rows.append(row)
    out = Rows(rows, task.for_rows(rows))
    out.lines, out.files = getattr(table, "lines", None), getattr(table, "files", [])
    return out

