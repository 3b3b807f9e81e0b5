"""The loaders part: the train loader (shuffled by ``train.seed``; length-grouped, padding-free, packed or sharded
for sequence parallelism as the config says) and the eval loader, and what one optimizer step holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from accelerate.logging import get_logger
from torch.utils.data import DataLoader

from scale.config.schema import Config
from scale.config.validation import ConfigError
from scale.data.collate import Collator, PackedCollator, PaddingFreeCollator
from scale.data.order import LengthGroupedSampler, PackedRows, pack_bfd
from scale.data.read import DataError
from scale.data.sequence import ShardCollator
from scale.data.tasks.preference import PackedPairCollator, PairCollator, PairedExamples, pair_capacity
from scale.data.token_table import Reordered, column, longest_first
from scale.data.tokenize import Splits
from scale.distributed.ulysses import SequenceParallel
from scale.training.parts.launch import Launch
from scale.training.schedule import steps_for_epochs

logger = get_logger(__name__)


@dataclass
class Loaders:
    """What the loaders part built (both loaders unprepared).

    Attributes:
        train: the train loader.
        eval: the eval loader.
        global_batch_size: rows (or with ``data.packing`` bins) per optimizer step, ``G``.
        bins: the train rows' bins (row indices) with ``data.packing``, else None.
    """

    train: DataLoader
    eval: DataLoader
    global_batch_size: int
    bins: list[list[int]] | None

    def max_steps(self, cfg: Config) -> int:
        """Optimizer steps of the run: ``train.max_steps``, else ``train.num_epochs`` epochs of the loader's items
        (with ``data.packing`` an epoch is ``len(bins)`` items, not ``len(rows)``)."""
        return cfg.train.max_steps or steps_for_epochs(len(self.train.dataset), self.global_batch_size,
                                                       cfg.train.num_epochs)


def build_loaders(launch: Launch, cfg: Config, splits: Splits, pad_token_id: int) -> Loaders:
    """Both loaders (:func:`make_loaders`) over the data-parallel ranks of ``launch``.

    Raises:
        DataError: a rank's shard of the train split would hold less than one micro-batch.
    """
    mb, world = cfg.train.micro_batch_size, launch.data_parallel_size
    train_dl, eval_dl = make_loaders(cfg, splits, pad_token_id, world, launch.sequence)
    items = len(train_dl.dataset)  # rows, or with data.packing the bins of rows the loader deals in
    if mb * world > items:
        raise DataError(f"train.micro_batch_size={mb} x data-parallel ranks={world} is larger than the train split "
                        f"({items} {unit_text(cfg)}): a rank's shard would hold less than one micro-batch. "
                        f"Lower train.micro_batch_size to at most {max(1, items // world)} or add data.")
    bins = train_dl.dataset.bins if isinstance(train_dl.dataset, PackedRows) else None
    return Loaders(train_dl, eval_dl, cfg.train.global_batch_size(world), bins)


def warn_larger_than_split(launch: Launch, cfg: Config, loaders: Loaders) -> None:
    """One warning when a global batch holds more than the train split: every optimizer step then sees at most
    one epoch."""
    G, items = loaders.global_batch_size, len(loaders.train.dataset)
    if G > items and launch.acc.is_main_process:
        logger.warning("global_batch_size=%d (micro_batch_size x gradient_accumulation_steps x data-parallel ranks) is "
                       "larger than the train split (%d %s): every optimizer step sees at most one epoch",
                       G, items, unit_text(cfg))


def unit_text(cfg: Config) -> str:
    """What the train loader deals in, for messages: rows (preference pairs under a preference
    ``loss.objective``), or with ``data.packing`` bins of them."""
    pairs = cfg.loss.trains_pairs()
    if not cfg.data.packing:
        return "pairs" if pairs else "rows"
    return (f"bins of up to 2 x data.max_length={cfg.data.max_length} = {2 * cfg.data.max_length} tokens" if pairs else
            f"bins of up to data.max_length={cfg.data.max_length} tokens")


def make_loaders(cfg: Config, splits: Splits, pad_token_id: int, data_parallel_size: int = 1,
                 sequence: SequenceParallel | None = None) -> tuple[DataLoader, DataLoader]:
    """The train loader (shuffled by ``train.seed``, re-shuffled each epoch) and the eval loader (unprepared).

    accelerate shards the train loader by whole micro-batches (rank ``r`` gets batches ``r, r + W, ...``), so
    every launch mode with the same global batch sees the same rows in every optimizer step. With
    ``data.group_by_length`` the order comes from :class:`scale.data.order.LengthGroupedSampler`, built from the
    global batch (``data_parallel_size`` ranks) before sharding, so that still holds. With ``data.padding_free``
    train micro-batches are packed rows (:class:`scale.data.collate.PaddingFreeCollator`); with ``data.packing`` the
    rows are first packed into bins of ``data.max_length`` tokens (:func:`scale.data.order.pack_bfd`), built from
    the stored lengths alone (the same bins on every rank), and the loader shuffles and shards bins.
    Under sequence parallelism (``sequence``) a train micro-batch becomes this rank's shard of its rows
    (:class:`scale.data.sequence.ShardCollator`); both loaders are later sharded over the data-parallel ranks only.
    """
    collate = Collator(pad_token_id, cfg.data.padding_side)
    train_collate = PaddingFreeCollator() if cfg.data.padding_free else collate
    t = cfg.train
    train, lengths = splits.train, column(splits.train, "length").tolist()  # per-row columns: no token read
    pairs = bool(splits.task.sides)  # preference: a pair is one item, its sides adjacent rows of a micro-batch
    if pairs:  # with data.packing, bins of whole pairs
        train, lengths, train_collate = paired(cfg, splits.train, sequence, train_collate)
    elif cfg.data.packing:  # the loader deals in bins of rows (scale.data.order.pack_bfd)
        train = PackedRows(splits.train, pack_bfd(lengths, cfg.data.max_length))
        lengths, train_collate = train.lengths(lengths), PackedCollator()
    if sequence is not None and not pairs:
        train_collate = ShardCollator(sequence.rank, sequence.size, pad_token_id,
                                      one_row=cfg.data.packing or cfg.data.padding_free)
    if cfg.data.group_by_length:
        sampler = LengthGroupedSampler(lengths, t.global_batch_size(data_parallel_size), cfg.data.mega_batch_steps,
                                       t.seed)
        # A generator of its own: each iter() of a DataLoader draws a base seed from it, else from the global
        # RNG, and a resumed run (one iter() more) would then draw other dropout masks.
        train_dl = DataLoader(train, batch_size=t.micro_batch_size, sampler=sampler, collate_fn=train_collate,
                              generator=torch.Generator().manual_seed(t.seed), num_workers=cfg.data.num_workers)
    else:
        train_dl = DataLoader(train, batch_size=t.micro_batch_size, shuffle=True, collate_fn=train_collate,
                              generator=torch.Generator().manual_seed(t.seed), num_workers=cfg.data.num_workers)
    # Evaluation order does not change its sums; longest first keeps padding (and peak memory) low.
    held = longest_pairs_first(splits.eval) if pairs else longest_first(splits.eval)  # a view of a cached split
    eval_dl = DataLoader(held, batch_size=t.eval_micro_batch_size, shuffle=False,
                         collate_fn=PairCollator(collate) if pairs else collate, num_workers=cfg.data.num_workers)
    return train_dl, eval_dl


def paired(cfg: Config, train: Any, sequence: Any, collate: Any) -> tuple[Any, list[int], PairCollator]:
    """A preference split as the loader's items: its pairs (:class:`PairedExamples`), each pair's longer side's
    length (what length grouping sorts by) and the collator that lays a micro-batch of pairs out as rows. With
    ``data.packing`` the items are bins of whole pairs (:func:`pack_bfd` on both sides' tokens, bins of
    :func:`scale.data.tasks.preference.pair_capacity` = 2 x ``data.max_length`` tokens), the lengths the bins'
    tokens, and a micro-batch is one padding-free row (:class:`PackedPairCollator`).

    Raises:
        ConfigError: sequence parallelism (not built for pairs yet).
    """
    if sequence is not None:
        raise ConfigError("loss.objective/data.format=preference trains pairs, which train.sequence_parallel_size > 1 "
                          "does not handle yet; set train.sequence_parallel_size=1")
    pairs = PairedExamples(train)
    if cfg.data.packing:
        sizes = pair_sizes(train)
        packed = PackedRows(pairs, pack_bfd(sizes.tolist(), pair_capacity(cfg.data.max_length)))
        return packed, packed.lengths(sizes), PackedPairCollator(PaddingFreeCollator())
    return pairs, pair_lengths(train).tolist(), PairCollator(collate)


def pair_sizes(examples: Any) -> np.ndarray:
    """``[pairs]`` tokens of each pair, both sides together (what a bin of packed pairs holds; no token read)."""
    lengths = column(examples, "length")
    return lengths[0::2] + lengths[1::2]


def pair_lengths(examples: Any) -> np.ndarray:
    """``[pairs]`` tokens of each pair's longer side (per-example lengths, no token read: sides 2p and 2p + 1)."""
    lengths = column(examples, "length")
    return np.maximum(lengths[0::2], lengths[1::2])


def longest_pairs_first(examples: Any) -> Reordered:
    """A preference split's pairs, longest first (the evaluation order: least padding, as for rows)."""
    return Reordered(PairedExamples(examples), np.argsort(-pair_lengths(examples), kind="stable"))
