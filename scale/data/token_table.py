"""The memory-mapped side of the token cache: a split read from an Arrow IPC file without copying it, and the
per-row columns (lengths, types) read without a token, in memory or cached (the sampler's lengths, the
evaluation's longest-first order). :mod:`scale.data.cache` writes the files.

No torch.distributed, no accelerate.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from scale.data.tasks.base import Example

SCALARS = ("length", "tail_len", "type_indicator", "target_token", "label", "row")
# Example fields stored as lists beside input_ids: ``trained`` (the tail's 0/1 flags; an empty list is ``None``)
LISTS = ("trained",)
# Example fields stored as text: ``extra`` (a format's JSON of the row; an empty string is ``None``)
TEXTS = ("extra",)


class TokenTable(Sequence):
    """The examples of one split, read from a memory-mapped Arrow file: ``table[i]`` is an :class:`Example`.

    Only the record batches' buffers are mapped; nothing is copied until an item (or :meth:`column`) is read.
    Pickles as its path and task (DataLoader workers map the file again).

    Args:
        path: an ``.arrow`` file written by :func:`scale.data.cache.write_table`.
        task: the prepared task that evaluates the split (``.task``; set by :func:`scale.data.tokenize.with_task`).
    """

    def __init__(self, path: str | Path, task: Any = None) -> None:
        self.path = str(path)
        self.task = task
        self._open()

    def _open(self) -> None:
        self._reader = pa.ipc.open_file(pa.memory_map(self.path, "r"))
        self._chunks, starts = [], [0]
        for k in range(self._reader.num_record_batches):
            batch = self._reader.get_batch(k)
            ids = batch.column("input_ids")
            lists = {c: (_numpy(batch.column(c).offsets), _numpy(batch.column(c).values)) for c in LISTS}
            lists |= {c: batch.column(c) for c in TEXTS if c in batch.schema.names}  # a cache built before: none
            self._chunks.append((_numpy(ids.offsets), _numpy(ids.values), {c: _numpy(batch.column(c)) for c in SCALARS},
                                 lists))
            starts.append(starts[-1] + batch.num_rows)
        self._starts = starts

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "task": self.task}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.task = state["path"], state.get("task")
        self._open()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> Example:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} of a {n}-row split")
        k = bisect.bisect_right(self._starts, i) - 1
        offsets, values, s, lists = self._chunks[k]
        j = i - self._starts[k]
        flag_offsets, flags = lists["trained"]
        trained = flags[flag_offsets[j]:flag_offsets[j + 1]].tolist() or None
        extra = lists["extra"][j].as_py() or None if "extra" in lists else None
        return Example(values[offsets[j]:offsets[j + 1]].tolist(), int(s["tail_len"][j]), int(s["type_indicator"][j]),
                       int(s["target_token"][j]), int(s["label"][j]), int(s["row"][j]), trained, extra)

    def column(self, name: str) -> np.ndarray:
        """One per-row column over the whole split (``length``, ``tail_len``, ``type_indicator``, ...): ``[N]``."""
        parts = [s[name] for _, _, s, _ in self._chunks]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _numpy(arr: pa.Array) -> np.ndarray:
    """A primitive Arrow array (no nulls) as a read-only numpy view of its buffer: no copy, and no pandas import
    (``to_numpy`` imports it)."""
    dtype = np.dtype(str(arr.type))
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


class Reordered(Sequence):
    """``base`` read in the order ``order`` (a view, nothing copied but the index)."""

    def __init__(self, base: Sequence, order: Sequence[int]) -> None:
        self.base, self.order = base, np.asarray(order, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> Example:  # type: ignore[override]
        return self.base[int(self.order[i])]


def column(examples: Sequence, name: str) -> np.ndarray:
    """A per-row column of a split, in memory or cached: ``length`` (tokens), ``tail_len``, ``type_indicator``,
    ``target_token``, ``label`` or ``row``; ``[N]`` int64. Reads no token of a :class:`TokenTable`."""
    if isinstance(examples, TokenTable):
        return examples.column(name).astype(np.int64)
    if name == "length":
        return np.array([len(e.input_ids) for e in examples], dtype=np.int64)
    return np.array([getattr(e, name) for e in examples], dtype=np.int64)


def longest_first(examples: Sequence) -> Sequence:
    """The examples longest first, equal lengths in their order: ``sorted(examples, key=-len)`` without
    reading the tokens of a cached split (the evaluation order)."""
    if not isinstance(examples, TokenTable):
        return sorted(examples, key=lambda e: -len(e.input_ids))
    return Reordered(examples, np.argsort(-column(examples, "length"), kind="stable"))
