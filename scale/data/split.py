"""Split: one source's rows -> its train and eval rows. No tokenizer, no torch.

The same steps for ``data.path`` and for every source of a mixture (:mod:`scale.data.mixing`):

1. exact duplicates go (``data.deduplicate``: the first of each group stays, :func:`scale.data.read.row_key`);
2. rows over ``data.max_text_chars`` characters of text go;
3. the rows are shuffled by ``train.seed`` and the first ``eval_size`` are held out (:func:`split_rows`), or,
   when the eval rows come from their own source (``data.eval_path`` / ``data.eval_split``), every row trains
   and the eval rows pass steps 1 and 2 themselves.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from scale.config.schema import DataConfig
from scale.data.read import DataError, row_key


def split_rows(rows: list[Any], eval_size: int, seed: int) -> tuple[list[Any], list[Any]]:
    """Deterministic shuffle by ``seed``; the first ``eval_size`` rows are the held-out split.

    Returns:
        ``(train_rows, eval_rows)``.

    Raises:
        DataError: fewer rows than ``eval_size + 1``.
    """
    if len(rows) <= eval_size:
        raise DataError(f"data has {len(rows)} rows but data.eval_size={eval_size}; lower data.eval_size")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in order[eval_size:]], [rows[i] for i in order[:eval_size]]


def deduplicate(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Keep the first of each group of exact duplicate rows (same content); return them and how many went."""
    seen: set[str] = set()
    kept = []
    for r in rows:
        key = row_key(r)
        if key not in seen:
            seen.add(key)
            kept.append(r)
    return kept, len(rows) - len(kept)


def count_copies(eval_rows: list[dict[str, Any]], train_rows: list[dict[str, Any]]) -> int:
    """How many eval rows are exact copies of a train row (:func:`scale.data.read.row_key`). Only the train rows
    whose text cells match an eval row's are keyed (a row_key is a JSON dump: ~30 us a row)."""
    def cells(r: dict[str, Any]) -> tuple:
        return tuple(v for k, v in sorted(r.items()) if isinstance(v, str))

    probe = {cells(r) for r in eval_rows}
    in_train = {row_key(r) for r in train_rows if cells(r) in probe}
    return sum(row_key(r) in in_train for r in eval_rows)


def cleaned(data_cfg: DataConfig, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Steps 1 and 2 of the module docstring: ``(rows kept, duplicates removed)``."""
    removed = 0
    if data_cfg.deduplicate:
        rows, removed = deduplicate(rows)
    if data_cfg.max_text_chars is not None:
        rows = [r for r in rows if len(r.get("text", "")) <= data_cfg.max_text_chars]
    return rows, removed


@dataclass
class Split:
    """One source, split: every row kept (``rows``, for the format's figures), ``train``, ``eval`` and the
    duplicates removed from both."""

    rows: list[dict[str, Any]]
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    removed: int


def split_source(data_cfg: DataConfig, rows: list[dict[str, Any]], seed: int, eval_size: int,
                 eval_rows: list[dict[str, Any]] | None = None, where: str | None = None) -> Split:
    """The module docstring's steps for one source.

    Args:
        rows: the source's rows (:func:`scale.data.tasks.load_rows`).
        seed: ``train.seed``.
        eval_size: rows held out of ``rows`` (``data.eval_size``, or a mixture source's share of it).
        eval_rows: the eval rows of their own source; then none is held out of ``rows``.
        where: a mixture's source (``data.datasets[i] (path)``), named when it has too few rows for its share.

    Raises:
        DataError: ``rows`` has no more than ``eval_size`` rows (:func:`split_rows`).
    """
    rows, removed = cleaned(data_cfg, rows)
    if eval_rows is None and where is not None and len(rows) <= eval_size:
        raise DataError(f"{where} has {len(rows)} rows but its share of data.eval_size={data_cfg.eval_size} is "
                        f"{eval_size}; lower data.eval_size or give the eval rows with data.eval_path")
    if eval_rows is None:
        train, held = split_rows(rows, eval_size, seed)
    else:
        train = split_rows(rows, 0, seed)[0]
        held, dropped = cleaned(data_cfg, eval_rows)
        removed += dropped
    return Split(rows, train, held, removed)
