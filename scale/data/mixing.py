"""Mixing: the rows a run trains and evaluates, from ``data.path`` or from several data sets mixed by weight
(``data.datasets``). No tokenizer calls, no torch.

    data:
      datasets:
        - {path: data/chat.jsonl, weight: 3}
        - {path: data/code/*.parquet, weight: 1, prompt_column: question, completion_column: answer}
      stopping_strategy: first_exhausted      # or all_exhausted (datasets.interleave_datasets' names)

One source (``data.path``) is split as :mod:`scale.data.split` says. With ``data.datasets`` each source is read
as ``data.path`` would be (any kind, its own columns and format: a null key of the entry takes ``data.*``'s) and
split the same way on its own: its eval rows are its share of ``data.eval_size`` (largest remainder), or come
from ``data.eval_path`` / each source's ``data.eval_split``. The mixed train split then holds exactly
``apportion(N, weights)[i]`` rows of source ``i``:

- ``first_exhausted`` (default): ``N`` is the largest size at which no source repeats a row (:func:`mixture_counts`),
  so the source that runs out first at its weight is used whole (or all but a row or so of the rounding) and the
  others contribute a subset (their first rows in the seeded shuffle);
- ``all_exhausted``: ``N`` is the smallest size at which every row is used; the smaller sources (at their
  weight) repeat, whole passes in their shuffled order first.

``data.max_train_examples`` caps ``N`` before the ratios are applied. The counts are exact integers (fractions of
the weights, the remainder to the largest quotas, ties to the earlier entry): over one epoch of the train split
each source contributes exactly its count, in every launch mode, since the split is built once (and cached)
before the loader shards it. Rows a format drops (``data.drop_long_completions``) are counted per source.

:class:`MixedTask` puts the sources' tasks behind one task, as nanochat's ``TaskMixture`` puts its tasks behind one
dataset: a row is encoded by its own source's format.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from scale.config.schema import DataConfig, LossConfig
from scale.config.validation import dataset_name
from scale.data.read import DataError, with_place
from scale.data.sources import eval_source_of, read_source, source_digest, source_kind
from scale.data.split import cleaned, split_source
from scale.data.tasks import MIXABLE, load_rows
from scale.data.tasks.base import Builder, Example, Rows, Task
from scale.utils.assets import DATASETS, resolve_data

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
    out = []
    for i, ds in enumerate(data_cfg.datasets):
        own = {k: getattr(ds, k) for k in READ_KEYS if getattr(ds, k) is not None}
        path = resolve_data(str(ds.path))
        out.append(Source(i, dataset_name(ds), ds.weight, replace(data_cfg, path=path, datasets=[], **own), path))
    return out


def _integer_weights(weights: Sequence[float]) -> list[int]:
    """The weights as integers in the same exact ratios (each a fraction over their common denominator)."""
    fractions = [Fraction(w) for w in weights]
    den = math.lcm(*(f.denominator for f in fractions))
    return [int(f * den) for f in fractions]


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split into non-negative integers proportional to ``weights`` (largest remainder, exact fractions;
    ties to the earlier entry). ``sum(result) == total``.

    >>> apportion(10, [3, 1])
    [8, 2]
    """
    ws = _integer_weights(weights)
    whole = sum(ws)
    counts = [total * w // whole for w in ws]  # each quota total * w / whole, rounded down
    remainders = [total * w % whole for w in ws]
    for i in sorted(range(len(ws)), key=lambda i: (-remainders[i], i))[:total - sum(counts)]:
        counts[i] += 1
    return counts


def mixture_counts(available: Sequence[int], weights: Sequence[float], strategy: str,
                   cap: int | None = None) -> list[int]:
    """Rows of each source in the mixed train split: ``apportion(N, weights)``, ``N`` capped at ``cap``, where

    - ``first_exhausted``: ``N`` is the largest size at which no row repeats (``apportion(N)[i] <= available[i]``
      for every source);
    - ``all_exhausted``: ``N`` is the smallest size at which every row is used (``apportion(N)[i] >=
      available[i]`` for every source).

    The largest remainder method can give a source fewer rows at a larger size (the Alabama paradox), so ``N`` is
    searched, not computed from the one source that runs out first (which gives 231 instead of 232 on the
    example of docs/data.md). ``apportion(n)[i]`` lies within one row of ``n * w_i / W``, which bounds the search
    to about ``W / w_i`` sizes.

    Args:
        available: train rows of each source.
        weights: ``data.datasets[i].weight``.
        strategy: ``first_exhausted`` or ``all_exhausted``.
        cap: ``data.max_train_examples`` (rows), or ``None``.
    """
    ws = _integer_weights(weights)
    whole = sum(ws)
    if strategy == "first_exhausted":
        # from n = ceil((a_i + 1) W / w_i) on, source i's share rounded down already exceeds its a_i rows
        top = min(-(-(a + 1) * whole // w) - 1 for a, w in zip(available, ws))
        total = next(n for n in range(top, -1, -1)
                     if all(c <= a for c, a in zip(apportion(n, weights), available)))
    else:
        # below n = floor((a_i - 1) W / w_i) + 1, source i's share rounded up is still under its a_i rows
        low = max(max((a - 1) * whole // w + 1, 0) for a, w in zip(available, ws))
        total = next(n for n in itertools.count(low)
                     if all(c >= a for c, a in zip(apportion(n, weights), available)))
    return apportion(min(total, cap) if cap is not None else total, weights)


def take(rows: list[Any], k: int) -> list[Any]:
    """The first ``k`` rows, cycling through ``rows`` (in their order) when ``k`` exceeds them."""
    whole, rest = divmod(k, len(rows))
    return rows * whole + rows[:rest]


def _evaluated(kinds: set[str]) -> str | None:
    if len(kinds) == 1:
        return next(iter(kinds))
    return next((fmt for allowed, fmt in MIXABLE.items() if kinds <= allowed), None)


def mixture_format(found: dict[int, str], srcs: list[Source]) -> str:
    """The format of the mixture (its evaluation): the one format of every source, or the evaluating format of
    a combination :data:`scale.data.tasks.MIXABLE` allows (prompt/completion rows with chats).

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
    """The formats of a mixture's sources behind one :class:`Task`: each row is encoded by the task of its source
    (the row's ``source``, one task per format), a row a format drops is counted for its source
    (``builder.notes``), and :attr:`evaluating` is the task of the format that evaluates the mixture.

    Args:
        of_source: the task of each source index (``-1``: the rows of ``data.eval_path``).
        evaluated: the format that evaluates the mixture (:func:`mixture_format`).
    """

    def __init__(self, of_source: dict[int, Task], evaluated: str) -> None:
        super().__init__()
        self.tasks: dict[str, Task] = {}
        for task in of_source.values():
            self.tasks.setdefault(task.name, task)
        self.of_source = {i: self.tasks[task.name] for i, task in of_source.items()}
        self.evaluating = self.tasks[evaluated]
        self.counted = tuple(dict.fromkeys(c for t in self.tasks.values() for c in t.counted))  # every format's

    def task_of(self, row: dict[str, Any]) -> Task:
        return self.of_source[row["source"]]

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
    """The rows a run trains and evaluates: ``train`` (one source's, or mixed at the weights and shuffled by
    ``train.seed``), ``eval``, every row read (``rows``, for the format's figures), the task that encodes them
    (``task``: the source's, or a :class:`MixedTask`), the task that evaluates them (``evaluating``), duplicates
    removed and, for a mixture, the per-source counts (``data/<name>/rows``, ``/train_rows``, ``/eval_rows``) and
    the sources' names; ``origins``: where a row comes from, ``{key: (source, rows as read)}`` (the rows'
    ``.lines`` say where a row number is in its file, :func:`scale.data.read.with_line`), keyed by the row's
    ``source`` in a mixture (``-1``: ``data.eval_path``), else by split (``train``, ``eval``, and ``check``, the
    checks over both, when both come from one source): :meth:`locate`."""

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    rows: list[dict[str, Any]]
    task: Task
    evaluating: Task
    removed: int
    stats: dict[str, int]
    names: list[str]
    origins: dict[Any, tuple[str, Any]] = field(default_factory=dict)

    def locate(self, message: str, split: str, source: int | None = None) -> str:
        """``message`` about a row of ``split`` (of mixture source ``source``) with the row's place: its line and
        its file after the first ``row N`` (:func:`scale.data.read.with_place`)."""
        path, rows = self.origins.get(split if source is None else source, (None, None))
        return with_place(message, rows, path)


def read_rows(data_cfg: DataConfig, path: str, seed: int) -> Mixture:
    """The train and eval rows of ``data.path`` (split by :func:`scale.data.split.split_source`, the train rows
    capped at ``data.max_train_examples``), or of ``data.datasets`` (:func:`read_mixture`; ``path`` is not read).

    Raises:
        DataError: a source that cannot be read or split; eval rows of another format than the train rows.
    """
    if data_cfg.datasets:
        return read_mixture(data_cfg, seed)
    rows = load_rows(data_cfg, path)
    # data.eval_path / data.eval_split: eval rows from their own source, none carved out of `path`; read by the
    # format's row checks here, checked with the train rows (Task.check) later.
    eval_source = eval_source_of(data_cfg, path)
    held = None
    if eval_source is not None:
        held = load_rows(*eval_source)
        if held.task.name != rows.task.name:
            raise DataError(f"the eval rows of {eval_source[1]} are {held.task.name} rows, the train rows of {path} "
                            f"{rows.task.name} rows; give both sources the same columns (or set data.format)")
    part = split_source(data_cfg, rows, seed, data_cfg.eval_size, held)
    train = part.train if data_cfg.max_train_examples is None else part.train[: data_cfg.max_train_examples]
    return Mixture(train, part.eval, part.rows, rows.task, rows.task, part.removed, {}, [],
                   {"train": (path, rows), "eval": (path, rows) if held is None else (eval_source[1], held),
                    **({"check": (path, rows)} if held is None else {})})


def _tagged(rows: Rows, index: int) -> Rows:
    """``rows`` with their source's index in ``source`` (:class:`MixedTask` finds a row's task by it;
    :func:`scale.data.read.row_key` ignores it)."""
    for r in rows:
        r["source"] = index
    return rows


def read_mixture(data_cfg: DataConfig, seed: int) -> Mixture:
    """Read, filter, split and mix every source of ``data.datasets`` (see the module docstring).

    Raises:
        DataError: a source that cannot be read (its own message), a source with fewer rows than its share of
            ``data.eval_size`` plus one, formats that cannot be mixed.
    """
    srcs = sources(data_cfg)
    eval_shares = apportion(data_cfg.eval_size, [s.weight for s in srcs])
    removed = 0
    found: dict[int, Task] = {}
    everything, trains, evals, stats = [], [], [], {}
    origins: dict[Any, tuple[str, Any]] = {}
    for s, share in zip(srcs, eval_shares):
        rows = _tagged(load_rows(s.cfg, s.path), s.index)
        found[s.index], origins[s.index] = rows.task, (s.path, rows)
        stats[f"data/{s.name}/rows"] = len(rows)
        held = None
        if data_cfg.eval_path is not None:
            held = []
        elif data_cfg.eval_split is not None:  # this source's own eval split
            held = _tagged(load_rows(replace(s.cfg, split=data_cfg.eval_split), s.path), s.index)
        part = split_source(data_cfg, rows, seed, share, held,
                            where=f"data.datasets[{s.index}] ({s.path})" if held is None else None)
        removed += part.removed
        everything += part.rows
        trains.append(part.train)
        evals.append(part.eval)
    fmt = mixture_format({i: t.name for i, t in found.items()}, srcs)
    counts = mixture_counts([len(t) for t in trains], [s.weight for s in srcs], data_cfg.stopping_strategy,
                            data_cfg.max_train_examples)
    train_rows = [r for t, k in zip(trains, counts) for r in take(t, k)]
    random.Random(seed).shuffle(train_rows)
    eval_rows = [r for held in evals for r in held]
    if data_cfg.eval_path is not None:
        eval_cfg, eval_path = eval_source_of(data_cfg, srcs[0].path)
        loaded = _tagged(load_rows(eval_cfg, eval_path), -1)
        found[-1], origins[-1] = loaded.task, (eval_path, loaded)
        if _evaluated({loaded.task.name, fmt}) != fmt:
            raise DataError(f"the eval rows of {eval_path} are {loaded.task.name} rows, the mixture's {fmt} rows; "
                            f"give data.eval_path the columns of the sources (or set data.format)")
        eval_rows, dropped = cleaned(data_cfg, loaded)
        removed += dropped
    for s, k, held in zip(srcs, counts, evals):
        stats[f"data/{s.name}/train_rows"] = k
        stats[f"data/{s.name}/eval_rows"] = len(held)
    task = MixedTask(found, fmt)
    return Mixture(train_rows, eval_rows, everything, task, task.evaluating, removed, stats, [s.name for s in srcs],
                   origins)


def dropped_per_source(notes: dict[str, int], names: list[str]) -> dict[str, int]:
    """``data/<name>/dropped_long_rows`` from the :class:`MixedTask`'s notes (train and eval rows)."""
    return {f"data/{name}/dropped_long_rows": notes.get(f"dropped:{i}", 0) for i, name in enumerate(names)}


def mixture_digest(data_cfg: DataConfig) -> str:
    """A sha256 of every source's content (:func:`scale.data.sources.source_digest`), in entry order."""
    h = hashlib.sha256()
    for s in sources(data_cfg):
        h.update(f"{s.name}\0{source_digest(s.cfg, s.path)}\n".encode())
    return h.hexdigest()


def sources_digests(data_cfg: DataConfig, path: str) -> dict[str, str | None]:
    """``{"source": ..., "eval_source": ...}``: :func:`scale.data.sources.source_digest` of ``path`` (with
    ``data.datasets``: of every source, :func:`mixture_digest`; ``path`` is not read) and of the eval source,
    ``None`` when the eval rows are carved out of the train source(s)."""
    if data_cfg.datasets:
        # each source's own data.eval_split rows are in its digest (a file, a directory, a hub revision)
        eval_source = eval_source_of(data_cfg, path) if data_cfg.eval_path is not None else None
        return {"source": mixture_digest(data_cfg),
                "eval_source": source_digest(*eval_source) if eval_source is not None else None}
    eval_source = eval_source_of(data_cfg, path)
    return {"source": source_digest(data_cfg, path),
            "eval_source": source_digest(*eval_source) if eval_source is not None else None}


def data_digest(cfg: Any, path: str) -> str:
    """The data-changed guard of a checkpoint (``TrainerState.data_sha256``): :func:`scale.data.sources.source_digest`
    of ``path`` (or every source of ``data.datasets``), combined with the eval source's when ``data.eval_path`` /
    ``data.eval_split`` is set."""
    digests = sources_digests(cfg.data, path)
    if digests["eval_source"] is None:
        return digests["source"]
    return hashlib.sha256(f"{digests['source']}\0{digests['eval_source']}".encode()).hexdigest()


def check_sources(data_cfg: DataConfig) -> None:
    """``data.path`` and ``data.eval_path`` name something that exists (a file, directory, glob, hub id or embedded
    data set), checked from the names alone: nothing is read, no library is imported, so ``scale-train`` reports a
    missing file before it imports transformers, peft and bitsandbytes (whose import-time notices would precede the
    one-line error). The sources of ``data.datasets`` are checked when they are read.

    Raises:
        DataError: the one line :func:`scale.data.sources.read_source` raises for a missing source.
    """
    for path in (data_cfg.path if not data_cfg.datasets else None, data_cfg.eval_path):
        if path and path not in DATASETS and source_kind(path) == "missing":
            read_source(data_cfg, path)  # raises at once for a missing source, reading nothing
