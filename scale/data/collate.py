"""Collation: tokenized examples -> the batch dicts the loss reads, padded or padding-free. No device placement.

Every example carries its per-token trained mask (:meth:`scale.data.tasks.base.Example.tail_flags`: 1 where a tail
token is trained, 0 on a chat's user/tool turns between two assistant turns); every collator here copies it into
``tail_mask`` the same way (:func:`tail_masks`), so a padded, a padding-free and a packed batch of the same
examples train the same tokens.

Padded (:class:`Collator`):

- ``input_ids`` ``[B, T]`` int64, ``attention_mask`` ``[B, T]`` int64 (left or right padded);
- ``tail_mask`` ``[B, N]`` int64, ``N`` the longest tail in the batch: each row's trained-token mask,
  right-aligned (column ``N - 1`` is every row's last real token; a row's tail spans from its first 1);
- ``type_indicator`` ``[B]`` int64: ``data.type_column``, the label's index, or 0;
- ``target_token`` ``[B]`` int64: a single-token label's id, or the ``target`` column's token (0 when none);
- ``label`` ``[B]`` int64: the label's index in ``data.labels`` (-1 without);
- ``row`` ``[B]`` int64: index of each example's row in the data file (error messages name it).

Padding-free (:class:`PaddingFreeCollator`) and packed (:class:`PackedCollator`, micro-batches of bins of rows,
:class:`scale.data.order.PackedRows`): the examples concatenated into one row ``input_ids`` ``[1, L]`` with
``position_ids`` ``[1, L]`` that restart at every example and ``seq_lens`` ``[B]`` instead of an attention mask;
``tail_mask`` and the per-example fields as above.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from scale.data.tasks.base import Example

PER_EXAMPLE = ("type_indicator", "target_token", "label", "row")


def tail_flags(e: Example) -> Tensor:
    """``[tail_len]`` int64: the example's trained-token mask (1 on its trained tail tokens)."""
    return torch.tensor(e.tail_flags(), dtype=torch.long)


def tail_masks(examples: list[Example]) -> Tensor:
    """``[B, N]`` int64, ``N`` the longest tail: each example's :func:`tail_flags`, right-aligned."""
    N = max(e.tail_len for e in examples)
    tail = torch.zeros((len(examples), N), dtype=torch.long)
    for b, e in enumerate(examples):
        tail[b, N - e.tail_len:] = tail_flags(e)
    return tail


def per_example_fields(examples: list[Example]) -> dict[str, Tensor]:
    """The per-example ``[B]`` long tensors every batch carries beside its tokens: ``type_indicator``,
    ``target_token``, ``label`` (index into ``data.labels``, -1 without) and ``row`` (data-file row)."""
    return {k: torch.tensor([getattr(e, k) for e in examples], dtype=torch.long) for k in PER_EXAMPLE}


class Collator:
    """Pad a list of :class:`Example` into a batch dict (see the module docstring for shapes).

    Args:
        pad_token_id: id written into padding positions (masked out by ``attention_mask``).
        padding_side: ``"left"`` or ``"right"``.
    """

    def __init__(self, pad_token_id: int, padding_side: str = "left") -> None:
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side

    def __call__(self, examples: list[Example]) -> dict[str, Tensor]:
        T = max(len(e.input_ids) for e in examples)
        ids = torch.full((len(examples), T), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(examples), T), dtype=torch.long)
        for b, e in enumerate(examples):
            n = len(e.input_ids)
            span = slice(T - n, T) if self.padding_side == "left" else slice(0, n)
            ids[b, span] = torch.tensor(e.input_ids, dtype=torch.long)
            mask[b, span] = 1
        return {"input_ids": ids, "attention_mask": mask, "tail_mask": tail_masks(examples),
                **per_example_fields(examples)}


class PaddingFreeCollator:
    """Pack a list of examples into one row without padding: transformers' packed-sequence format.

    The examples are concatenated in order; ``position_ids`` restart at 0 for each, and no ``attention_mask``
    is passed to the model, so transformers builds a block-diagonal causal mask from the position ids
    (``masking_utils.find_packed_sequence_indices``; sdpa and eager on CPU, flash-attention varlen on GPU):
    no token attends across examples. This is the semantics of ``transformers.DataCollatorWithFlattening``,
    plus the fields the tail loss needs. Measured exact against the padded batch on CPU (fp32 round-off,
    ``tests/test_sampling.py``); the model must be called with ``use_cache=False`` (a cache turns the
    packed-sequence detection off), as :func:`scale.loss.tail.forward_tail` does.

    Returns a dict with ``input_ids`` ``[1, L]`` (``L`` = total tokens), ``position_ids`` ``[1, L]``,
    ``seq_lens`` ``[B]`` (tokens of each example), ``tail_mask`` ``[B, N]`` (each example's trained-token mask)
    and per example ``type_indicator``, ``target_token``, ``label``, ``row`` ``[B]``, as :class:`Collator` has them.
    """

    def __call__(self, examples: list[Any]) -> dict[str, Tensor]:
        ids = [torch.tensor(e.input_ids, dtype=torch.long) for e in examples]
        return {
            "input_ids": torch.cat(ids)[None],
            "position_ids": torch.cat([torch.arange(len(x)) for x in ids])[None],
            "seq_lens": torch.tensor([len(x) for x in ids], dtype=torch.long),
            "tail_mask": tail_masks(examples),
            **per_example_fields(examples),
        }


class PackedCollator(PaddingFreeCollator):
    """:class:`PaddingFreeCollator` for micro-batches of bins (:class:`scale.data.order.PackedRows`): the bins'
    examples, in order, become one packed row ``[1, L]`` (``L`` <= ``micro_batch_size x data.max_length``)."""

    def __call__(self, bins: list[list[Any]]) -> dict[str, Tensor]:  # type: ignore[override]
        return super().__call__([e for b in bins for e in b])
