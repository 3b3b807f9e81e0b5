"""Sequence-parallel rows: each of the ``N`` ranks of a sequence-parallel group holds ``1/N`` of every row.

Plain tensors only (no accelerate, no torch.distributed): :mod:`scale.distributed.ulysses` runs the attention that joins
the shards, this module builds them. Shapes: ``R`` rows of the micro-batch, ``T`` padded row length (a
multiple of ``N``), ``C = T / N`` positions per shard, ``E`` examples, ``K`` this shard's tail predictions per
example (the widest example's, at least 1).

How a micro-batch becomes shards (:func:`shard_rows`), identically on every rank of the group, which all
received the same micro-batch (the loader is sharded over the data-parallel ranks only):

1. **one example per row** (``data.packing``/``data.padding_free``: the micro-batch's examples in one row),
   starting at column 0, position ids ``0..len-1`` per example, then padded on the right to ``T``, the
   longest row rounded up to a multiple of ``N``. No attention mask: Ulysses drops masks (a ``[T, T]`` mask
   is what it exists to avoid) and the core attention runs causal, so a real token never sees the padding
   after it. Several examples in one row stay apart only under an attention that reads the restarting
   position ids (flash-attention's varlen path): :func:`scale.modeling.attention.check_sequence_parallel` refuses
   packing otherwise.
2. **labels shifted before the split**: the prediction at position ``p`` is scored against token ``p + 1``,
   which may lie on the next rank's shard; each trained tail token's *predictor* position, its target and its
   flag are taken from the whole row first.
3. **each rank keeps its slice** ``[r C, (r + 1) C)`` of the tokens and position ids, and the trained tail
   predictions whose predictor position falls in it: ``shard_index [E, K]`` (flat index into the shard's
   ``[R, C]`` positions), ``shard_targets [E, K]`` and ``tail_mask [E, K]`` (1 on trained tail tokens). A
   shard may hold no tail prediction at all (the normal case for a tail): its ``tail_mask`` is all zero, its
   weights sum to exactly 0 and its loss numerator is an exact 0, never a mean of nothing (NaN).

The loss of a shard is then the tail loss of its own predictions (:func:`scale.loss.tail.forward_tail` takes the
shard's tail-only logits); the loop adds numerators and weights over the window and over every rank (data- and
sequence-parallel alike) and divides once, so the sum over the ``N`` shards is the whole row's loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from scale.data.collate import per_example_fields, tail_flags

SHARD_KEY = "shard_index"
"""A batch holding this key is one rank's shard of sequence-parallel rows (:func:`shard_rows`)."""


def padded_length(longest: int, sp_size: int) -> int:
    """``T``: ``longest`` tokens rounded up to a multiple of ``sp_size`` (every shard the same length)."""
    return -(-longest // sp_size) * sp_size


def shard_rows(rows: Sequence[Sequence[Any]], sp_rank: int, sp_size: int, pad_token_id: int) -> dict[str, Tensor]:
    """Rank ``sp_rank``'s shard of a micro-batch of rows (the module docstring).

    Args:
        rows: ``R`` rows, each a list of examples (:class:`scale.data.Example`: ``input_ids``, ``tail_len``,
            trained flags) laid out one after the other.
        sp_rank: this rank's index in its sequence-parallel group (``0 <= sp_rank < sp_size``).
        sp_size: ``N``, ranks per sequence-parallel group.
        pad_token_id: the id written into padding positions (never attended by a real token).

    Returns:
        ``input_ids [R, C]``, ``position_ids [R, C]`` (this shard's slice), ``shard_index [E, K]``,
        ``shard_targets [E, K]``, ``tail_mask [E, K]``, ``row_lens [E]`` and ``row_tails [E]`` (each example's
        tokens and tail length, for the row checks), ``shard_tokens []`` (real tokens in this shard),
        ``sp_first []`` (1 on rank 0 of the group: it counts the rows once), and per example ``type_indicator``,
        ``target_token``, ``label``, ``row`` ``[E]``.

    Raises:
        ValueError: ``sp_rank`` outside ``0..sp_size-1``.
    """
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} must lie in 0..{sp_size - 1}")
    R = len(rows)
    lengths = [sum(len(e.input_ids) for e in row) for row in rows]
    T = padded_length(max(lengths), sp_size)
    C = T // sp_size
    lo, hi = sp_rank * C, (sp_rank + 1) * C
    ids = torch.full((R, T), pad_token_id, dtype=torch.long)
    pos = torch.zeros((R, T), dtype=torch.long)
    examples, index, targets = [], [], []
    for r, row in enumerate(rows):
        off = 0
        for e in row:
            x = torch.tensor(list(e.input_ids), dtype=torch.long)
            L = len(x)
            ids[r, off:off + L] = x
            pos[r, off:off + L] = torch.arange(L)
            trained = torch.arange(L - e.tail_len, L)[tail_flags(e).bool()]  # token t, predicted at t - 1
            pred = off + trained - 1                                          # predictor positions in the row
            here = (pred >= lo) & (pred < hi)
            index.append(r * C + pred[here] - lo)
            targets.append(x[trained[here]])
            examples.append(e)
            off += L
        pos[r, off:] = torch.arange(T - off)  # the padding run as a sequence of its own (varlen attention)
    E, K = len(examples), max(1, max(len(i) for i in index))
    shard_index = torch.zeros((E, K), dtype=torch.long)
    shard_targets = torch.zeros((E, K), dtype=torch.long)
    mask = torch.zeros((E, K), dtype=torch.long)
    row_of = [r for r, row in enumerate(rows) for _ in row]
    for i, (idx, tgt) in enumerate(zip(index, targets)):
        n = len(idx)
        shard_index[i] = idx[0] if n else row_of[i] * C  # columns left of the tail repeat a valid position
        if n:
            shard_index[i, K - n:] = idx
            shard_targets[i, K - n:] = tgt
            mask[i, K - n:] = 1
    real = torch.zeros((R, T), dtype=torch.bool)
    for r, n in enumerate(lengths):
        real[r, :n] = True
    return {
        "input_ids": ids[:, lo:hi].contiguous(),
        "position_ids": pos[:, lo:hi].contiguous(),
        SHARD_KEY: shard_index,
        "shard_targets": shard_targets,
        "tail_mask": mask,
        "row_lens": torch.tensor([len(e.input_ids) for e in examples], dtype=torch.long),
        "row_tails": torch.tensor([e.tail_len for e in examples], dtype=torch.long),
        "shard_tokens": real[:, lo:hi].sum(),
        "sp_first": torch.tensor(int(sp_rank == 0)),
        **per_example_fields(examples),
    }


class ShardCollator:
    """The train collator under sequence parallelism: a micro-batch of examples (or of packed bins) -> this rank's
    shard of its rows (:func:`shard_rows`).

    Args:
        sp_rank: this rank's index in its sequence-parallel group.
        sp_size: ``N``.
        pad_token_id: the padding id.
        one_row: the micro-batch's examples share one row (``data.padding_free``, or ``data.packing`` whose items
            are bins of examples): the layout of :class:`scale.data.order.PaddingFreeCollator`, for an attention that
            keeps packed examples apart.
    """

    def __init__(self, sp_rank: int, sp_size: int, pad_token_id: int, one_row: bool = False) -> None:
        self.sp_rank, self.sp_size, self.pad_token_id, self.one_row = sp_rank, sp_size, pad_token_id, one_row

    def __call__(self, items: list[Any]) -> dict[str, Tensor]:
        flat = [e for item in items for e in (item if isinstance(item, list) else [item])]
        rows = [flat] if self.one_row else [[e] for e in flat]
        return shard_rows(rows, self.sp_rank, self.sp_size, self.pad_token_id)


def shard_padded(input_ids: Tensor, attention_mask: Tensor | None, keep: Tensor, sp_rank: int, sp_size: int,
                 pad_token_id: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A padded batch (left or right) as sequence-parallel rows, for a forward that must look unsharded (evaluation).

    Each row's real tokens (one contiguous run) are moved to column 0 with position ids ``0, 1, ...`` (what
    :func:`scale.loss.tail.forward_tail` gives them under either padding side), the rows are padded on the right to
    ``T'`` (the longest rounded up to a multiple of ``sp_size``), and rank ``sp_rank`` keeps columns
    ``[r C, (r + 1) C)``. The logits asked for at padded positions ``keep`` are mapped to the new layout.

    Args:
        input_ids: ``[B, T]``.
        attention_mask: ``[B, T]`` 1 on real tokens (``None``: no padding).
        keep: ``[K]`` positions of the padded layout whose logits the caller wants (``logits_to_keep``).
        sp_rank, sp_size: this rank's place in its group, ``N``.
        pad_token_id: written into the padding (never attended by a real token: attention is causal).

    Returns:
        ``(input_ids [B, C], position_ids [B, C], local [B, K], here [B, K])``: this shard's tokens and positions,
        each wanted logit's column in this shard (clamped into ``0..C-1``) and whether it lies in this shard. A
        wanted position left of a row's first token (padding, whose logits no caller reads) maps to column 0 of
        the row: a finite stand-in.
    """
    B, T = input_ids.shape
    device = input_ids.device
    mask = attention_mask.long() if attention_mask is not None else torch.ones_like(input_ids)
    lens, first = mask.sum(1), mask.argmax(1)                                     # [B] (first: 0 for an empty row)
    Tp = padded_length(max(1, int(lens.max())), sp_size)                          # host sync (evaluation only)
    C, lo = Tp // sp_size, sp_rank * (Tp // sp_size)
    cols = torch.arange(Tp, device=device)
    src = (first[:, None] + cols[None, :]).clamp(max=T - 1)
    ids = torch.where(cols[None, :] < lens[:, None], input_ids.gather(1, src), pad_token_id)
    pos = cols[None, :].expand(B, Tp)
    local = (keep[None, :].to(device) - first[:, None]).clamp(0, Tp - 1) - lo    # [B, K]
    here = (local >= 0) & (local < C)
    return ids[:, lo:lo + C].contiguous(), pos[:, lo:lo + C].contiguous(), local.clamp(0, C - 1), here
