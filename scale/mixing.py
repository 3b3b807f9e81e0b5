"""Several data sets mixed by weight: ``data.datasets`` [issue 18]. No tokenizer calls, no torch.

    data:
      datasets:
        - {path: data/chat.jsonl, weight: 3}
        - {path: data/code/*.parquet, weight: 1, prompt_column: question, completion_column: answer}
      stopping_strategy: first_exhausted      # or all_exhausted (datasets.interleave_datasets' names)

Each source is read as ``data.path`` would be (any kind, its own columns and format: a null key of the entry
takes ``data.*``'s), de-duplicated and filtered on its own, and split by ``train.seed`` on its own: its eval rows
are its share of ``data.eval_size`` (largest remainder), or come from ``data.eval_path`` / each source's
``data.eval_split``. The mixed train split then holds exactly ``apportion(N, weights)[i]`` rows of source ``i``:

- ``first_exhausted`` (default): ``N`` is the largest size at which no source repeats a row, so the source that
  runs out first at its weight is used whole and the others contribute a subset (their first rows in the seeded
  shuffle);
- ``all_exhausted``: ``N`` is the smallest size at which every row is used; the smaller sources (at their
  weight) repeat, whole passes in their shuffled order first.

``data.max_train_examples`` caps ``N`` before the ratios are applied. The counts are exact integers (fractions of
the weights, the remainder to the largest quotas, ties to the earlier entry): over one epoch of the train split
each source contributes exactly its count, in every launch mode, since the split is built once (and cached)
before the loader shards it. Rows a format drops (``data.drop_long_completions``) are counted per source.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from scale.config import DataConfig, LossConfig
from scale.formats import DataError
from scale.validation import dataset_name
from scale.tasks.base import Builder, Example, Task

READ_KEYS = ("format", "split", "subset", "text_column", "label_column", "prompt_column", "completion_column",
             "messages_column", "tools_column", "target_column", "type_column", "column_names")


@dataclass
class Source:
    """One entry of ``data.datasets``, resolved: its index, metric name, weight, reading config and path."""

    index: int
    name: str
    weight: float
    cfg: DataConfig
    path: str


def sources(data_cfg: DataConfig) -> list[Source]:
    """The entries of ``data.datasets`` with their own ``DataConfig`` (null keys take ``data.*``) and their path
    resolved (an embedded name is prepared)."""
    from scale.assets import resolve_data

    out = []
    for i, ds in enumerate(data_cfg.datasets):
        own = {k: getattr(ds, k) for k in READ_KEYS if getattr(ds, k) is not None}
        path = resolve_data(str(ds.path))
        out.append(Source(i, dataset_name(ds), ds.weight, replace(data_cfg, path=path, datasets=[], **own), path))
    return out


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split into non-negative integers proportional to ``weights`` (largest remainder, exact fractions;
    ties to the earlier entry). ``sum(result) == total``.

    >>> apportion(10, [3, 1])
    [8, 2]
    """
    fractions = [Fraction(w) for w in weights]
    whole = sum(fractions)
    quotas = [total * f / whole for f in fractions]
    counts = [int(q) for q in quotas]  # floor: quotas are >= 0
    for i in sorted(range(len(quotas)), key=lambda i: (counts[i] - quotas[i], i))[:total - sum(counts)]:
        counts[i] += 1
    return counts


def mixture_counts(available: Sequence[int], weights: Sequence[float], strategy: str,
                   cap: int | None = None) -> list[int]:
    """Rows of each source in the mixed train split (see the module docstring).

    Args:
        available: train rows of each source.
        weights: ``data.datasets[i].weight``.
        strategy: ``first_exhausted`` or ``all_exhausted``.
        cap: ``data.max_train_examples`` (rows), or ``None``.
    """
    fractions = [Fraction(w) for w in weights]
    whole = sum(fractions)
    if strategy == "first_exhausted":
        total = min(int(n * whole / f) for n, f in zip(available, fractions))  # no source past its rows
    else:
        total = max(-(-n * whole // f) for n, f in zip(available, fractions))  # ceil: every row at least once
        total = int(total)
    return apportion(min(total, cap) if cap is not None else total, weights)


def take(rows: list[Any], k: int) -> list[Any]:
    """The first ``k`` rows, cycling through ``rows`` (in their order) when ``k`` exceeds them."""
    whole, rest = divmod(k, len(rows))
    return rows * whole + rows[:rest]


def _evaluated(kinds: set[str]) -> str | None:
    from scale.tasks import MIXABLE

    if len(kinds) == 1:
        return next(iter(kinds))
    return next((fmt for allowed, fmt in MIXABLE.items() if kinds <= allowed), None)


def mixture_format(found: dict[int, str], srcs: list[Source]) -> str:
    """The format of the mixture (its evaluation): the one format of every source, or the evaluating format of
    a combination :data:`scale.tasks.MIXABLE` allows (prompt/completion rows with chats).

    Raises:
        DataError: sources of formats that cannot be trained and evaluated together.
    """
    evaluated = _evaluated(set(found.values()))
    if evaluated is not None:
        return evaluated
    first = srcs[0]
    other = next(s for s in srcs if found[s.index] != found[first.index])
    raise DataError(f"data.datasets[{other.index}] ({other.path}) holds {found[other.index]} rows but "
                    f"data.datasets[{first.index}] ({first.path}) {found[first.index]} rows: a mixture trains one "
                    f"format (or prompt_completion with messages); set data.datasets[{other.index}].format and its "
                    f"*_column keys, or train the sources in separate runs")


class MixedTask(Task):
    """The formats of a mixture's rows behind one :class:`Task`: each row is encoded by its own format's task
    (found from its keys), and a row a format drops is counted for its source (``builder.notes``)."""

    def __init__(self, tasks: dict[str, Task]) -> None:
        self.tasks = tasks
        self._of: dict[frozenset, Task] = {}
        self.counted = tuple(dict.fromkeys(c for t in tasks.values() for c in t.counted))  # every format's counts

    def task_of(self, row: dict[str, Any]) -> Task:
        from scale.tasks import row_format

        keys = frozenset(row)
        if keys not in self._of:
            self._of[keys] = self.tasks[row_format(row)]
        return self._of[keys]

    def prepare(self, tokenizer: Any, data_cfg: DataConfig, loss_cfg: LossConfig) -> None:
        for task in self.tasks.values():
            task.prepare(tokenizer, data_cfg, loss_cfg)

    def check(self, tokenizer: Any, rows: list[dict[str, Any]]) -> None:
        for task in self.tasks.values():
            task.check(tokenizer, [r for r in rows if self.task_of(r) is task])

    def encode(self, row: dict[str, Any], b: Builder, loss_cfg: LossConfig) -> Example | None:
        e = self.task_of(row).encode(row, b, loss_cfg)
        if e is None:
            key = f"dropped:{row['source']}"
            b.notes[key] = b.notes.get(key, 0) + 1
        return e

    def texts(self, row: dict[str, Any], cfg: DataConfig) -> list[str]:
        return self.task_of(row).texts(row, cfg)

    def info(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for task in self.tasks.values():
            out.update(task.info([r for r in rows if self.task_of(r) is task]))
        return out

    def fingerprint(self) -> str:
        return "\0".join(self.tasks[name].fingerprint() for name in sorted(self.tasks))


@dataclass
class Mixture:
    """The rows of a mixture, split: ``train`` (mixed at the weights, shuffled by ``train.seed``), ``eval``,
    every row read (``rows``, for the format's info), the format, its task, duplicates removed and the
    per-source counts (``data/<name>/rows``, ``/train_rows``, ``/eval_rows``)."""

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    rows: list[dict[str, Any]]
    format: str
    task: MixedTask
    removed: int
    stats: dict[str, int]
    names: list[str]


def read_mixture(data_cfg: DataConfig, seed: int) -> Mixture:
    """Read, filter, split and mix every source of ``data.datasets`` (see the module docstring).

    Raises:
        DataError: a source that cannot be read (its own message), a source with fewer rows than its share of
            ``data.eval_size`` plus one, formats that cannot be mixed.
    """
    from scale.data import deduplicate, split_rows
    from scale.sources import eval_source_of
    from scale.tasks import get, load_rows, row_format

    srcs = sources(data_cfg)
    eval_shares = apportion(data_cfg.eval_size, [s.weight for s in srcs])
    removed = 0
    found: dict[int, str] = {}
    everything, trains, evals, stats = [], [], [], {}
    for s, share in zip(srcs, eval_shares):
        rows = load_rows(s.cfg, s.path)
        for r in rows:
            r["source"] = s.index  # MixedTask counts dropped rows per source; row_key ignores it
        found[s.index] = row_format(rows[0])
        stats[f"data/{s.name}/rows"] = len(rows)
        if data_cfg.deduplicate:
            rows, dropped = deduplicate(rows)
            removed += dropped
        if data_cfg.max_text_chars is not None:
            rows = [r for r in rows if len(r.get("text", "")) <= data_cfg.max_text_chars]
        everything += rows
        if data_cfg.eval_path is not None:
            train, held = split_rows(rows, 0, seed)[0], []
        elif data_cfg.eval_split is not None:  # this source's own eval split
            train = split_rows(rows, 0, seed)[0]
            held = load_rows(replace(s.cfg, split=data_cfg.eval_split), s.path)
            for r in held:
                r["source"] = s.index
        else:
            if len(rows) <= share:
                raise DataError(f"data.datasets[{s.index}] ({s.path}) has {len(rows)} rows but its share of "
                                f"data.eval_size={data_cfg.eval_size} is {share}; lower data.eval_size or give the "
                                f"eval rows with data.eval_path")
            train, held = split_rows(rows, share, seed)
        trains.append(train)
        evals.append(held)
    fmt = mixture_format(found, srcs)
    counts = mixture_counts([len(t) for t in trains], [s.weight for s in srcs], data_cfg.stopping_strategy,
                            data_cfg.max_train_examples)
    train_rows = [r for t, k in zip(trains, counts) for r in take(t, k)]
    random.Random(seed).shuffle(train_rows)
    eval_rows = [r for held in evals for r in held]
    if data_cfg.eval_path is not None:
        eval_cfg, eval_path = eval_source_of(data_cfg, srcs[0].path)
        eval_rows = load_rows(eval_cfg, eval_path)
        for r in eval_rows:
            r["source"] = -1
        found[-1] = row_format(eval_rows[0])
        if _evaluated({found[-1], fmt}) != fmt:
            raise DataError(f"the eval rows of {eval_path} are {found[-1]} rows, the mixture's {fmt} rows; give "
                            f"data.eval_path the columns of the sources (or set data.format)")
    for s, k, held in zip(srcs, counts, evals):
        stats[f"data/{s.name}/train_rows"] = k
        stats[f"data/{s.name}/eval_rows"] = len(held)
    task = MixedTask({name: get(name) for name in sorted(set(found.values()))})
    return Mixture(train_rows, eval_rows, everything, fmt, task, removed, stats, [s.name for s in srcs])


def dropped_per_source(notes: dict[str, int], names: list[str]) -> dict[str, int]:
    """``data/<name>/dropped_long_rows`` from the :class:`MixedTask`'s notes (train and eval rows)."""
    return {f"data/{name}/dropped_long_rows": notes.get(f"dropped:{i}", 0) for i, name in enumerate(names)}


def mixture_digest(data_cfg: DataConfig) -> str:
    """A sha256 of every source's content (:func:`scale.sources.source_digest`), in entry order."""
    from scale.sources import source_digest

    h = hashlib.sha256()
    for s in sources(data_cfg):
        h.update(f"{s.name}\0{source_digest(s.cfg, s.path)}\n".encode())
    return h.hexdigest()
