"""Order: how train rows are ordered and grouped into micro-batches: length-grouped sampling (less padding, the
same optimizer steps in every launch mode) and packing rows into bins (``data.packing``).

    sampler = LengthGroupedSampler(lengths, cfg.train.global_batch_size(world), mega_batch_steps=16, seed=1234)
    DataLoader(train, batch_size=mb, sampler=sampler, ...)   # accelerate shards it by whole micro-batches

Why it keeps parity: accelerate shards a map-style train loader by whole micro-batches (rank ``r`` of ``W``
gets micro-batches ``r, r + W, r + 2W, ...``), so optimizer step ``s`` trains on rows
``[s * G, (s + 1) * G)`` of the sampler's index order, ``G = micro_batch_size x gradient_accumulation_steps x
num_processes``, in every launch mode with the same ``G``. This sampler builds that order *before* sharding,
from ``(seed, epoch, G)`` alone:

1. a random permutation of the rows (``torch.randperm`` seeded with ``seed + epoch``, as accelerate's
   seedable sampler does);
2. cut into mega-batches of ``mega_batch_steps`` global batches; each mega-batch is sorted by length, longest
   first (a stable sort: equal lengths keep their random order);
3. each sorted mega-batch is cut into global batches of ``G`` rows, and the full ones are put in a random
   order, so that a step's length does not follow its position in the mega-batch; a partial global batch
   (the epoch's last, shortest rows) stays last.

Inside a global batch the rows run longest to shortest, so every micro-batch (a contiguous slice of
``micro_batch_size`` rows, whatever that is) holds rows of similar length. Which rows train in which step
does not depend on ``micro_batch_size`` or the number of processes; how they are padded does, and the tail
loss does not see padding.

A padding-free micro-batch (:class:`scale.data.collate.PaddingFreeCollator`) is one packed row with position ids
that restart at every example, which transformers' attention masks treat as separate sequences (no padding at all).
With ``data.packing`` (:func:`pack_bfd`, :class:`PackedRows`) the rows are first packed, best-fit-decreasing,
into bins of at most ``data.max_length`` tokens; the sampler and the loader then deal in bins, so a micro-batch
holds ``micro_batch_size`` bins (about ``micro_batch_size x max_length`` tokens), whatever the row lengths.

No accelerate, no torch.distributed: a plain ``torch.utils.data.Sampler``. It has no ``generator``
attribute, so ``accelerate.prepare`` leaves it as it is (it only swaps a ``RandomSampler``), and
``DataLoaderShard.set_epoch`` reaches it through the batch sampler; ``skip_first_batches`` (resume) wraps
the same batch sampler, so a resumed epoch continues the same order.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler


def length_grouped_order(lengths: Sequence[int], global_batch_size: int, mega_batch_steps: int, seed: int,
                         epoch: int = 0) -> list[int]:
    """The epoch's row order: shuffled, then grouped by length inside mega-batches (see the module docstring).

    Args:
        lengths: tokens of each row (``len(example.input_ids)``).
        global_batch_size: ``G``, rows per optimizer step over all ranks.
        mega_batch_steps: global batches sorted together (1: each global batch sorted on its own).
        seed: ``train.seed``.
        epoch: the epoch; each epoch gets its own permutation.

    Returns:
        A permutation of ``range(len(lengths))``.

    Raises:
        ValueError: ``global_batch_size`` or ``mega_batch_steps`` is below 1.
    """
    if global_batch_size < 1 or mega_batch_steps < 1:
        raise ValueError(f"global_batch_size={global_batch_size} and mega_batch_steps={mega_batch_steps} must be >= 1")
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    G, span = global_batch_size, global_batch_size * mega_batch_steps
    order: list[int] = []
    for start in range(0, len(perm), span):
        mega = sorted(perm[start:start + span], key=lambda i: -lengths[i])
        batches = [mega[j:j + G] for j in range(0, len(mega), G)]
        tail = [batches.pop()] if len(batches[-1]) < G else []  # the epoch's partial global batch stays last
        for b in torch.randperm(len(batches), generator=g).tolist():
            order.extend(batches[b])
        for b in tail:
            order.extend(b)
    return order


class LengthGroupedSampler(Sampler[int]):
    """Row indices of the train split, grouped by length into deterministic global batches.

    Args:
        lengths: tokens of each row.
        global_batch_size: ``G = micro_batch_size x gradient_accumulation_steps x num_processes``.
        mega_batch_steps: global batches (optimizer steps) whose rows are sorted by length together.
        seed: ``train.seed``.

    Raises:
        ValueError: see :func:`length_grouped_order`.
    """

    def __init__(self, lengths: Sequence[int], global_batch_size: int, mega_batch_steps: int, seed: int) -> None:
        if global_batch_size < 1 or mega_batch_steps < 1:
            raise ValueError(f"global_batch_size={global_batch_size} and mega_batch_steps={mega_batch_steps} "
                             f"must be >= 1")
        self.lengths = list(lengths)
        self.global_batch_size = global_batch_size
        self.mega_batch_steps = mega_batch_steps
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next ``iter()`` on (called by ``DataLoaderShard.set_epoch``)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        yield from length_grouped_order(self.lengths, self.global_batch_size, self.mega_batch_steps, self.seed,
                                        self.epoch)

    def __len__(self) -> int:
        return len(self.lengths)


def pad_fraction(lengths: Sequence[int], order: Sequence[int], micro_batch_size: int) -> float:
    """Share of padded positions when ``order`` is cut into micro-batches of ``micro_batch_size`` rows
    (each padded to its longest row): ``1 - real tokens / (rows x padded length)``, summed over micro-batches."""
    real = total = 0
    for i in range(0, len(order), micro_batch_size):
        chunk = [lengths[j] for j in order[i:i + micro_batch_size]]
        real += sum(chunk)
        total += len(chunk) * max(chunk)
    return 1.0 - real / total if total else 0.0


def pack_bfd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack rows into bins of at most ``capacity`` tokens, best-fit-decreasing; no row is split.

    Rows are taken longest first (ties: lower index first); each goes into the open bin with the least room
    that still fits it, else a new bin. Deterministic (a function of ``lengths`` and ``capacity`` only), so
    every rank and every resume builds the same bins. The bins' room is kept as a sorted list of the distinct
    free sizes (at most ``capacity`` of them) with a stack of bins per size: O(rows x log capacity) lookups.
    BFD is the strategy of TRL's ``pack_dataset(strategy="bfd")`` (trl/data_utils.py), without its truncation.

    Args:
        lengths: tokens of each row (``len(example.input_ids)``), each in ``1..capacity``.
        capacity: tokens per bin (``data.max_length``).

    Returns:
        Bins of row indices; every row in exactly one bin, each bin's rows longest first. Bins are listed in
        the order they were opened (the first holds the longest row).

    Raises:
        ValueError: ``capacity`` < 1, or a row is empty or longer than ``capacity`` (names the row).
    """
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1 token")
    bins: list[list[int]] = []
    sizes: list[int] = []                  # sorted distinct free sizes that some bin has
    by_size: dict[int, list[int]] = {}     # free size -> bins with that room (a stack: deterministic)
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = int(lengths[i])
        if not 1 <= n <= capacity:
            raise ValueError(f"row {i} has {n} tokens; packing needs 1..{capacity} (data.max_length)")
        k = bisect.bisect_left(sizes, n)
        if k < len(sizes):  # best fit: the smallest room that holds the row
            free = sizes[k]
            b = by_size[free].pop()
            if not by_size[free]:
                del by_size[free], sizes[k]
        else:
            b, free = len(bins), capacity
            bins.append([])
        bins[b].append(i)
        left = free - n
        if left > 0:
            if left not in by_size:
                by_size[left] = []
                bisect.insort(sizes, left)
            by_size[left].append(b)
    return bins


class PackedRows(Dataset):
    """A split seen as bins of rows (:func:`pack_bfd`): item ``i`` is the list of examples of bin ``i``.

    Args:
        rows: the train split (any sequence of examples; a memory-mapped cached split stays one).
        bins: row indices per bin.
    """

    def __init__(self, rows: Any, bins: list[list[int]]) -> None:
        self.rows, self.bins = rows, bins

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, i: int) -> list[Any]:
        return [self.rows[j] for j in self.bins[i]]

    def lengths(self, row_lengths: Sequence[int]) -> list[int]:
        """Tokens of each bin, from the rows' lengths."""
        return [sum(int(row_lengths[j]) for j in b) for b in self.bins]
