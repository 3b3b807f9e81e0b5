"""Tail loss: cross-entropy over each row's tail (its last ``tail_len`` real tokens). Plain tensors only.

Shapes: ``B`` rows, ``T`` padded length, ``N`` the longest tail of the batch, ``V`` vocabulary.

A batch carries ``tail_mask [B, N]`` (:mod:`scale.data.collate`): 1 on each row's tail, right-aligned, so
column ``N - 1`` is every row's last real token. The ``text`` format's tail is the last ``loss.threshold``
tokens (every row the same); prompt/completion and chat tails differ per row. The tail is found from
``attention_mask`` (never from tensor positions), so the same example gives the same loss under left or
right padding. Token ``t`` is predicted by the logits at position ``t - 1``, so a row needs at least
``tail_len + 1`` real tokens. The model is asked only for the logits it needs (``logits_to_keep``): under
left padding the ``N`` positions before the end, under right padding the union of the rows' positions;
never ``[B, T, V]`` unless a tail really spans a row.

Every loss here returns a *numerator* (sum of weighted token losses) and a *denominator* (sum of
weights); the training loop adds both over the whole accumulation window and all ranks and divides once.
Weights are ``tail_mask * type weight``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from scale.utils.wrapped import base_model

PACKED_SEQ_LENS = "packed_seq_lens"
"""Model keyword argument: the lengths of the examples of a packed row (a tuple of ints), passed by
:func:`forward_tail_packed` when the model attends with :mod:`scale.modeling.varlen`'s per-example attention."""
SEGMENTS_SUFFIX = "_segments"
"""Suffix of the attention implementations :mod:`scale.modeling.varlen` registers (``sdpa_segments``...)."""

SHARD_KEY = "shard_index"
"""A batch holding this key is one rank's shard of sequence-parallel rows (:func:`scale.data.sequence.shard_rows`)."""


def _tail_mask(attention_mask: Tensor, tail: Tensor | int) -> Tensor:
    """``tail`` as a ``[B, N]`` mask: an int means every row's tail is that long."""
    if isinstance(tail, int):
        return torch.ones(attention_mask.shape[0], tail, dtype=torch.long, device=attention_mask.device)
    return tail.long()


def tail_lengths(tail_mask: Tensor) -> Tensor:
    """``[B]`` tail length of each row: from its first 1 through column ``N - 1`` (a chat's tail holds 0s
    where user/tool tokens sit between trained turns; a contiguous tail's length is its sum). No host sync."""
    mask = tail_mask.long()
    N = mask.shape[1]
    return torch.where(mask.any(1), N - mask.argmax(1), torch.zeros_like(mask[:, 0]))


def bad_rows(attention_mask: Tensor, tail_mask: Tensor | int) -> Tensor:
    """Which rows the tail loss cannot score, on the device (no host sync).

    Args:
        attention_mask: ``[B, T]``.
        tail_mask: ``[B, N]`` (or ``N``, every row's tail length).

    Returns:
        ``[B]`` bool: the row's mask is not one contiguous run of 1s, or it has fewer than ``tail_len + 1``
        real tokens (its first tail token would have no prediction).
    """
    mask = attention_mask.long()
    T = mask.shape[1]
    lengths = mask.sum(1)
    first = mask.argmax(1)
    last = (T - 1) - mask.flip(1).argmax(1)
    gap = (last - first + 1) != lengths
    return gap | (lengths < tail_lengths(_tail_mask(mask, tail_mask)) + 1)


def describe_bad_row(attention_mask: Tensor, tail_mask: Tensor | int, rows: Tensor | None = None) -> str:
    """The message for the first row :func:`bad_rows` flags (host sync: for the error path only)."""
    tails = tail_lengths(_tail_mask(attention_mask, tail_mask))
    b = int(bad_rows(attention_mask, tail_mask).nonzero()[0, 0])
    where = f"row {b} of the batch" + (f" (data-file row {int(rows[b])})" if rows is not None else "")
    mask = attention_mask[b].long()
    n, tail = int(mask.sum()), int(tails[b])
    if n and int(mask.nonzero()[-1, 0] - mask.nonzero()[0, 0] + 1) != n:
        return f"attention_mask {where} is not one contiguous run of 1s (left or right padding)"
    return (f"{where} has {n} real tokens; its tail of {tail} tokens needs at least {tail + 1} (each tail token "
            f"is predicted from the token before it). Lower loss.threshold or drop short rows.")


def batch_bad_rows(batch: dict[str, Tensor]) -> Tensor:
    """:func:`bad_rows` of a collated batch, padded, padding-free (``seq_lens``: each packed row needs more
    tokens than its tail) or a sequence-parallel shard (``row_lens``/``row_tails`` of the whole examples,
    :func:`scale.data.sequence.shard_rows`); ``[B]`` bool, on the device (no host sync)."""
    if SHARD_KEY in batch:
        return batch["row_lens"] < batch["row_tails"] + 1
    if "seq_lens" in batch:
        return batch["seq_lens"] < tail_lengths(batch["tail_mask"]) + 1
    return bad_rows(batch["attention_mask"], batch["tail_mask"])


def describe_batch_row(batch: dict[str, Tensor]) -> str:
    """The message for the first row :func:`batch_bad_rows` flags (host sync: for the error path only)."""
    if "seq_lens" not in batch and SHARD_KEY not in batch:
        return describe_bad_row(batch["attention_mask"], batch["tail_mask"], batch.get("row"))
    b = int(batch_bad_rows(batch).nonzero()[0, 0])
    n, tail = ((int(batch["row_lens"][b]), int(batch["row_tails"][b])) if SHARD_KEY in batch
               else (int(batch["seq_lens"][b]), int(tail_lengths(batch["tail_mask"])[b])))
    where = f"row {b} of the batch" + (f" (data-file row {int(batch['row'][b])})" if "row" in batch else "")
    return (f"{where} has {n} real tokens; its tail of {tail} tokens needs at least {tail + 1} (each tail token "
            f"is predicted from the token before it). Lower loss.threshold or drop short rows.")


def check_rows(batch: dict[str, Tensor], tail_mask: Tensor | int) -> None:
    """Raise for a row the tail loss cannot score (one host sync).

    Raises:
        ValueError: a row's mask has a gap, or the row holds fewer than ``tail_len + 1`` real tokens.
    """
    mask = batch["attention_mask"]
    if bool(bad_rows(mask, tail_mask).any()):  # host sync: data validation
        raise ValueError(describe_bad_row(mask, tail_mask, batch.get("row")))


def tail_positions(attention_mask: Tensor, tail_mask: Tensor | int) -> Tensor:
    """Positions of each row's tail tokens.

    Args:
        attention_mask: ``[B, T]``, 1 for real tokens (one contiguous run per row: left or right padded).
        tail_mask: ``[B, N]`` right-aligned tail mask, or ``N`` (every row's tail is ``N`` tokens).

    Returns:
        ``[B, N]`` int64 positions in ascending order; the last column is each row's last real token.
        Columns outside a row's tail repeat its first tail position (they carry weight 0).

    Raises:
        ValueError: see :func:`check_rows`.
    """
    mask = attention_mask.long()
    tails = _tail_mask(mask, tail_mask)
    check_rows({"attention_mask": mask}, tails)
    T, N = mask.shape[1], tails.shape[1]
    last = (T - 1) - mask.flip(dims=[1]).argmax(dim=1)            # [B] last real position
    span = last[:, None] - torch.arange(N - 1, -1, -1, device=mask.device)[None, :]
    first = last - tail_lengths(tails) + 1                        # [B] first tail position
    return torch.maximum(span, first[:, None])


@dataclass
class TailBatch:
    """Indices the model needs for one batch.

    Attributes:
        keep: ``[K]`` sorted sequence positions whose logits the model must return (``logits_to_keep``).
        gather: ``[B, N]`` index into the ``K`` kept positions, one per tail prediction.
        targets: ``[B, N]`` token ids the tail predictions are scored against.
    """

    keep: Tensor
    gather: Tensor
    targets: Tensor


def tail_batch(input_ids: Tensor, attention_mask: Tensor, tail_mask: Tensor | int) -> TailBatch:
    """Work out which logits a batch needs: the predictions of each row's tail tokens.

    Args:
        input_ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T]`` 1 for real tokens.
        tail_mask: ``[B, N]`` (or ``N``).

    Returns:
        A :class:`TailBatch`; pass ``keep`` as ``logits_to_keep`` to a transformers causal LM.

    Raises:
        ValueError: see :func:`check_rows`.
    """
    tail = tail_positions(attention_mask, tail_mask)            # [B, N] positions of tail tokens
    pred = tail - 1                                              # [B, N] positions that predict them
    keep, inverse = torch.unique(pred, sorted=True, return_inverse=True)
    return TailBatch(keep=keep, gather=inverse, targets=input_ids.gather(1, tail))


def select_tail_logits(kept_logits: Tensor, tb: TailBatch) -> Tensor:
    """Pick each row's tail predictions out of the kept logits.

    Args:
        kept_logits: ``[B, K, V]`` logits at ``tb.keep``.
        tb: from :func:`tail_batch`.

    Returns:
        ``[B, N, V]`` logits; row ``b``, column ``j`` predicts ``tb.targets[b, j]``.
    """
    V = kept_logits.shape[-1]
    return kept_logits.gather(1, tb.gather[:, :, None].expand(-1, -1, V))


def token_weights(type_indicator: Tensor, tail_mask: Tensor | int, type_weights: list[float] | None) -> Tensor:
    """Weight of each tail token: the tail mask times its row's type weight.

    Args:
        type_indicator: ``[B]`` int type per example.
        tail_mask: ``[B, N]`` (or ``N``: every row's tail is ``N`` tokens).
        type_weights: weight per type id, or None for weight 1 everywhere.

    Returns:
        ``[B, N]`` float32 weights, 0 outside each row's tail.

    Raises:
        ValueError: a type id has no entry in ``type_weights``.
    """
    mask = _tail_mask(type_indicator[:, None], tail_mask).float()
    if type_weights is None:
        return mask
    table = torch.tensor(type_weights, dtype=torch.float32, device=type_indicator.device)
    if bool((type_indicator >= len(type_weights)).any() | (type_indicator < 0).any()):
        raise ValueError(f"type_indicator holds ids outside loss.type_weights (length {len(type_weights)}); "
                         f"give one weight per type id")
    return table[type_indicator][:, None] * mask


Criterion = Callable[..., Tensor]
CRITERION_MODE = "input"
"""How :class:`LossSpec` calls its criterion: with the type ids (:func:`load_criterion` adapts a ``plain`` one)."""


def load_criterion(path: str, mode: str = "input") -> Criterion:
    """Import a user criterion from ``'package.module:function'``.

    Args:
        mode: ``loss.criterion_mode``: ``"input"``, the function takes ``(logits, labels, type_indicator)``;
            ``"plain"``, it takes ``(logits, labels)`` and the returned criterion drops the type ids it is given.

    Returns:
        A criterion ``(logits [M, V], labels [M], type_indicator [M]) -> [M] or a mean``.

    Raises:
        ValueError: the path is malformed, or the module/function cannot be found.
    """
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"loss.criterion={path!r} cannot be imported: {e}") from e
    if not callable(fn):
        raise ValueError(f"loss.criterion={path!r} is not callable")
    return bind_criterion(fn, mode)


def bind_criterion(fn: Criterion, mode: str) -> Criterion:
    """``fn`` as :class:`LossSpec` calls a criterion, with the type ids: a ``plain`` one (``(logits, labels)``)
    gets a wrapper that drops them, an ``input`` one is returned as it is."""
    if mode == "plain":
        return functools.wraps(fn)(lambda logits, labels, type_indicator=None: fn(logits, labels))
    return fn


def tail_loss(
    tail_logits: Tensor,
    targets: Tensor,
    weights: Tensor,
    type_indicator: Tensor | None = None,
    criterion: Criterion | None = None,
    criterion_mode: str = "plain",
) -> tuple[Tensor, Tensor]:
    """Weighted token cross-entropy over the tail, as a numerator and a denominator.

    ``loss = numerator / denominator`` is the weighted mean over the tail tokens; sum both over an
    accumulation window (and over ranks) before dividing so that the result equals one big batch.

    Args:
        tail_logits: ``[B, N, V]`` predictions of the tail tokens (any float dtype; computed in float32).
        targets: ``[B, N]`` token ids.
        weights: ``[B, N]`` per-token weights (:func:`token_weights`), 0 outside each row's tail; with a user
            criterion, the tail mask (its tokens are those with weight > 0).
        type_indicator: ``[B]`` type per example; needed when ``criterion_mode == "input"``.
        criterion: optional user function ``(logits [M, V], labels [M]) -> [M] or scalar mean`` over the ``M``
            tail tokens (with ``criterion_mode="input"`` also ``type_indicator [M]``, the row's type per
            token). Selecting the ``M`` tokens is a host sync when the tails differ in length.
        criterion_mode: ``"plain"`` or ``"input"``.

    Returns:
        ``(numerator, denominator)``, both float32 scalars ``[]`` (the numerator float64 for float64 logits: the
        exactness checks of the chunked loss run in float64).
    """
    B, N, V = tail_logits.shape
    flat_logits = tail_logits.reshape(B * N, V)
    flat_logits = flat_logits if flat_logits.dtype == torch.float64 else flat_logits.float()  # fp64: kept
    flat_targets = targets.reshape(B * N)
    w = weights.reshape(B * N).float()
    if criterion is None:
        token_loss = F.cross_entropy(flat_logits, flat_targets, reduction="none")   # [B * N]
        # Outside the tail the logits may belong to padding: mask, never multiply a possible inf/NaN by 0.
        return (token_loss.masked_fill(w == 0, 0.0) * w).sum(), w.sum()
    keep = w > 0
    if not bool(keep.any()):  # host sync (the selection below syncs anyway)
        # No trained token (a sequence-parallel shard without tail, a stand-in): an exact 0 that still reaches the
        # model in backward, never a criterion's mean of nothing (NaN).
        return flat_logits[:0].float().sum(), keep.sum().float()
    args = (flat_logits[keep], flat_targets[keep])
    if criterion_mode == "input":
        args += (type_indicator[:, None].expand(B, N).reshape(B * N)[keep],)
    out = criterion(*args)
    count = keep.sum().float()
    # A user criterion returns per-token losses [M] (summed) or their mean (times M tokens).
    numerator = out.float().sum() if out.dim() == 1 else out.float() * count
    return numerator, count


def forward_tail(model: torch.nn.Module, batch: dict[str, Tensor], threshold: int | None = None,
                 padding_side: str = "left", check: bool = True) -> tuple[Tensor, Tensor]:
    """Run a causal LM and return only the tail predictions.

    Calls ``model(input_ids, attention_mask, position_ids, logits_to_keep=keep, use_cache=False)``: the LM
    head sees ``[B, K, H]`` hidden states (``K = N`` under left padding, the union of the rows' predictor
    positions under right padding), never ``[B, T, H]`` unless a tail spans a whole row.

    Args:
        model: a transformers causal LM (plain, PEFT-wrapped or accelerate-prepared).
        batch: ``input_ids [B, T]``, ``attention_mask [B, T]`` and ``tail_mask [B, N]`` (without it, every
            row's tail is ``threshold`` tokens).
        threshold: ``N`` for a batch without ``tail_mask``; must equal its width otherwise.
        padding_side: ``"left"`` means every row ends at ``T - 1``, so the kept positions are known without
            a device-to-host sync. ``"right"`` (or any padding) finds each row's tail from the mask.
        check: validate the rows first (:func:`check_rows`; one host sync). The training loop checks every
            window's rows inside its one per-step all-gather instead and passes ``False``.

    Returns:
        ``(tail_logits [B, N, V], targets [B, N])``; positions outside a row's tail (``tail_mask == 0``) hold
        arbitrary predictions.

    Raises:
        ValueError: ``check`` and a row cannot be scored (see :func:`check_rows`); a ``threshold`` that
            disagrees with ``tail_mask``.
    """
    if SHARD_KEY in batch:  # one rank's shard of sequence-parallel rows (scale.data.sequence.shard_rows)
        if check and bool(batch_bad_rows(batch).any()):  # host sync: data validation
            raise ValueError(describe_batch_row(batch))
        return forward_tail_shard(model, batch)
    if "seq_lens" in batch:  # a padding-free micro-batch (scale.data.collate.PaddingFreeCollator)
        if check and bool(batch_bad_rows(batch).any()):  # host sync: data validation
            raise ValueError(describe_batch_row(batch))
        return forward_tail_packed(model, batch)
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    tails = batch.get("tail_mask")
    if tails is None:
        if threshold is None:
            raise ValueError("the batch has no tail_mask: pass threshold (every row's tail length)")
        tails = threshold
    elif threshold is not None and threshold != tails.shape[1]:
        raise ValueError(f"threshold={threshold} but the batch's tail_mask is {tails.shape[1]} wide")
    if check:
        check_rows(batch, tails)
    # Positions count real tokens only, so a left-padded row sees the same positions as a right-padded one.
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    if padding_side == "left":
        T, N = input_ids.shape[1], tails if isinstance(tails, int) else tails.shape[1]
        keep = torch.arange(T - N - 1, T - 1, device=input_ids.device)
        tb = None
        targets = input_ids[:, T - N:]
    else:
        tb = tail_batch(input_ids, mask, tails)
        keep, targets = tb.keep, tb.targets
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=keep,
                use_cache=False)
    return (out.logits if tb is None else select_tail_logits(out.logits, tb)), targets


def forward_tail_packed(model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`forward_tail` for a padding-free micro-batch: ``B`` rows packed into one row of ``L`` tokens.

    Calls ``model(input_ids [1, L], position_ids [1, L], logits_to_keep=keep, use_cache=False)`` without an
    attention mask: transformers then reads the packed rows from the restarting position ids and keeps the
    attention inside each row. Row ``b``'s tail is the last ``tail_len_b`` tokens of its segment; the LM head
    sees ``B x N`` positions, never ``L``.

    Args:
        model: a transformers causal LM.
        batch: ``input_ids [1, L]``, ``position_ids [1, L]``, ``seq_lens [B]`` and the right-aligned
            ``tail_mask [B, N]`` (every row holds more tokens than its tail).

    Returns:
        ``(tail_logits [B, N, V], targets [B, N])``; columns outside a row's tail repeat its first tail
        position (they carry weight 0).
    """
    input_ids, seq_lens, tails = batch["input_ids"], batch["seq_lens"], batch["tail_mask"]
    B, N = tails.shape
    ends = seq_lens.cumsum(0) - 1                                                   # [B] last token of each row
    pos = ends[:, None] - torch.arange(N - 1, -1, -1, device=ends.device)[None, :]  # [B, N] tail positions
    pos = torch.maximum(pos, (ends - tail_lengths(tails) + 1)[:, None])              # not before the row's tail
    out = model(input_ids=input_ids, position_ids=batch["position_ids"], logits_to_keep=(pos - 1).reshape(-1),
                use_cache=False, **packed_kwargs(model, seq_lens))
    return out.logits.reshape(B, N, -1), input_ids[0, pos]


def packed_kwargs(model: torch.nn.Module, seq_lens: Tensor) -> dict[str, tuple[int, ...]]:
    """The keyword arguments a packed row's forward passes: ``{PACKED_SEQ_LENS: (l_1, ..., l_B)}`` when the model
    attends with :mod:`scale.modeling.varlen`'s per-example attention (its ``_attn_implementation`` ends in
    :data:`SEGMENTS_SUFFIX`), else none. Reads ``seq_lens [B]`` on the host: that attention runs on CPU only."""
    name = getattr(getattr(base_model(model), "config", None), "_attn_implementation", None)
    if not (isinstance(name, str) and name.endswith(SEGMENTS_SUFFIX)):
        return {}
    return {PACKED_SEQ_LENS: tuple(int(n) for n in seq_lens.tolist())}


def forward_tail_shard(model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`forward_tail` for this rank's shard of sequence-parallel rows: only this shard's tail predictions.

    Calls ``model(input_ids [R, C], position_ids [R, C], logits_to_keep=keep, use_cache=False)`` without an
    attention mask (the sequence-parallel attention, :mod:`scale.distributed.ulysses`, joins the shards and runs
    causal); the LM head sees the columns of this shard's tail predictions only (``keep``: the union over the rows, as
    under right padding), never ``C``. The targets were shifted before the row was split, so a prediction at the
    shard's last position is scored against the next shard's first token.

    Args:
        model: a transformers causal LM under sequence parallelism.
        batch: :func:`scale.data.sequence.shard_rows`'s shard: ``input_ids``, ``position_ids``, ``shard_index [E, K]``
            (flat ``[R, C]`` positions), ``shard_targets [E, K]``.

    Returns:
        ``(tail_logits [E, K, V], targets [E, K])``; columns with ``tail_mask == 0`` repeat a position of the
        example's row (weight 0).
    """
    index, C = batch[SHARD_KEY], batch["input_ids"].shape[1]
    keep, inverse = torch.unique(index % C, sorted=True, return_inverse=True)      # [Kc], [E, K]
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], logits_to_keep=keep,
                use_cache=False)
    R, Kc = out.logits.shape[:2]
    flat = out.logits.reshape(R * Kc, -1)                                           # [R x Kc, V]
    return flat[(index // C) * Kc + inverse], batch["shard_targets"]
