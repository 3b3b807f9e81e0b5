"""Tail loss: cross-entropy over the last ``threshold`` real tokens of each row. Plain tensors only.

Shapes: ``B`` rows, ``T`` padded length, ``N = threshold`` tail tokens, ``V`` vocabulary, ``M = B * N``.

The tail is found from ``attention_mask`` (never from tensor positions), so the same example gives the
same loss under left or right padding. Token ``t`` is predicted by the logits at position ``t - 1``, so a
row needs at least ``N + 1`` real tokens. The model is asked only for the logits it needs
(``logits_to_keep``), never for ``[B, T, V]``.

Every loss here returns a *numerator* (sum of weighted token losses) and a *denominator* (sum of
weights); the training loop adds both over the whole accumulation window and all ranks and divides once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from scale.config import Config


def tail_positions(attention_mask: Tensor, threshold: int) -> Tensor:
    """Positions of the last ``threshold`` real tokens of each row.

    Args:
        attention_mask: ``[B, T]``, 1 for real tokens (one contiguous run per row: left or right padded).
        threshold: ``N``, tail length in tokens.

    Returns:
        ``[B, N]`` int64 positions in ascending order; the last column is each row's last real token.

    Raises:
        ValueError: a row has fewer than ``N + 1`` real tokens (its first tail token would have no
            prediction), or the mask is not one contiguous run.
    """
    mask = attention_mask.long()
    B, T = mask.shape
    lengths = mask.sum(dim=1)
    short = (lengths < threshold + 1).nonzero()
    if short.numel():
        row = int(short[0, 0])  # host sync: data validation, once per batch
        raise ValueError(f"row {row} has {int(lengths[row])} real tokens; the tail loss needs at least "
                         f"loss.threshold + 1 = {threshold + 1}. Lower loss.threshold or drop short rows.")
    # Last real position: T - 1 - (index of the first 1 in the flipped mask).
    last = (T - 1) - mask.flip(dims=[1]).argmax(dim=1)
    offsets = torch.arange(threshold, -1, -1, device=mask.device)
    span = last[:, None] - offsets[None, :]                       # [B, N + 1]: predictor + tail positions
    if bool((span < 0).any()) or not bool(mask.gather(1, span.clamp(min=0)).all()):
        raise ValueError("attention_mask rows must be one contiguous run of 1s (left or right padding)")
    return span[:, 1:]


@dataclass
class TailBatch:
    """Indices the model needs for one batch.

    Attributes:
        keep: ``[K]`` sorted sequence positions whose logits the model must return (``logits_to_keep``);
            ``K = N`` under left padding.
        gather: ``[B, N]`` index into the ``K`` kept positions, one per tail prediction.
        targets: ``[B, N]`` token ids the tail predictions are scored against.
    """

    keep: Tensor
    gather: Tensor
    targets: Tensor


def tail_batch(input_ids: Tensor, attention_mask: Tensor, threshold: int) -> TailBatch:
    """Work out which logits a batch needs: the predictions of its last ``threshold`` real tokens.

    Args:
        input_ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T]`` 1 for real tokens.
        threshold: ``N`` tail tokens.

    Returns:
        A :class:`TailBatch`; pass ``keep`` as ``logits_to_keep`` to a transformers causal LM.

    Raises:
        ValueError: see :func:`tail_positions`.
    """
    tail = tail_positions(attention_mask, threshold)            # [B, N] positions of tail tokens
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


def token_weights(type_indicator: Tensor, threshold: int, type_weights: list[float] | None) -> Tensor:
    """Weight of each tail token from its row's type.

    Args:
        type_indicator: ``[B]`` int type per example.
        threshold: ``N``.
        type_weights: weight per type id, or None for weight 1 everywhere.

    Returns:
        ``[B, N]`` float32 weights.

    Raises:
        ValueError: a type id has no entry in ``type_weights``.
    """
    B = type_indicator.shape[0]
    if type_weights is None:
        return torch.ones(B, threshold, device=type_indicator.device)
    table = torch.tensor(type_weights, dtype=torch.float32, device=type_indicator.device)
    if bool((type_indicator >= len(type_weights)).any() | (type_indicator < 0).any()):
        raise ValueError(f"type_indicator holds ids outside loss.type_weights (length {len(type_weights)}); "
                         f"give one weight per type id")
    return table[type_indicator][:, None].expand(B, threshold)


Criterion = Callable[..., Tensor]


def load_criterion(path: str) -> Criterion:
    """Import a user criterion from ``'package.module:function'``.

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
        weights: ``[B, N]`` per-token weights (:func:`token_weights`); a user criterion gets weight 1.
        type_indicator: ``[B]`` type per example; needed when ``criterion_mode == "input"``.
        criterion: optional user function ``(logits [M, V], labels [M]) -> [M] or scalar mean`` (with
            ``criterion_mode="input"`` also ``type_indicator [M]``, the row's type repeated per token).
        criterion_mode: ``"plain"`` or ``"input"``.

    Returns:
        ``(numerator, denominator)``, both float32 scalars ``[]``.
    """
    B, N, V = tail_logits.shape
    flat_logits = tail_logits.reshape(B * N, V).float()
    flat_targets = targets.reshape(B * N)
    if criterion is None:
        token_loss = F.cross_entropy(flat_logits, flat_targets, reduction="none")   # [M]
        w = weights.reshape(B * N).float()
        return (token_loss * w).sum(), w.sum()
    args = (flat_logits, flat_targets)
    if criterion_mode == "input":
        args += (type_indicator[:, None].expand(B, N).reshape(B * N),)
    out = criterion(*args)
    count = torch.tensor(float(B * N), device=flat_logits.device)
    # A user criterion returns per-token losses [M] (summed) or their mean (times M tokens).
    numerator = out.float().sum() if out.dim() == 1 else out.float() * count
    return numerator, count


@dataclass
class TargetStats:
    """Per-example classification figures at the target position.

    Attributes:
        logprob: ``[B]`` log-probability (nats) of ``target_token``.
        correct: ``[B]`` 1.0 where the target is the argmax over the label tokens, else 0.0.
    """

    logprob: Tensor
    correct: Tensor


@torch.no_grad()
def target_stats(tail_logits: Tensor, target_token: Tensor, label_token_ids: Tensor, position: int) -> TargetStats:
    """Log-probability of each row's target token and label-set accuracy.

    Args:
        tail_logits: ``[B, N, V]`` predictions of the tail tokens.
        target_token: ``[B]`` token id of each row's label word.
        label_token_ids: ``[L]`` token ids of the label set.
        position: which tail token is the label, counted from the end (``-1`` = last real token); its
            prediction is ``tail_logits[:, N + position]``.

    Returns:
        :class:`TargetStats`.
    """
    logits = tail_logits[:, tail_logits.shape[1] + position].float()        # [B, V]
    logprob = logits.log_softmax(-1).gather(1, target_token[:, None]).squeeze(1)
    pred = label_token_ids[logits[:, label_token_ids].argmax(-1)]
    return TargetStats(logprob=logprob, correct=(pred == target_token).float())


def forward_tail(model: torch.nn.Module, batch: dict[str, Tensor], threshold: int,
                 padding_side: str = "left") -> tuple[Tensor, Tensor]:
    """Run a causal LM and return only the tail predictions.

    Calls ``model(input_ids, attention_mask, position_ids, logits_to_keep=keep, use_cache=False)``: the LM
    head sees ``[B, K, H]`` hidden states (``K = N`` under left padding), never ``[B, T, H]``.

    Args:
        model: a transformers causal LM (plain, PEFT-wrapped or accelerate-prepared).
        batch: ``input_ids [B, T]`` and ``attention_mask [B, T]``.
        threshold: ``N``.
        padding_side: ``"left"`` means every row ends at ``T - 1``, so the kept positions are known without
            a device-to-host sync; rows must hold at least ``N + 1`` real tokens (the data pipeline checks).
            ``"right"`` (or any padding) finds each row's tail from the mask.

    Returns:
        ``(tail_logits [B, N, V], targets [B, N])``.
    """
    if "seq_lens" in batch:  # a padding-free micro-batch (scale.sampling.PaddingFreeCollator)
        return forward_tail_packed(model, batch, threshold)
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    # Positions count real tokens only, so a left-padded row sees the same positions as a right-padded one.
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    if padding_side == "left":
        T = input_ids.shape[1]
        keep = torch.arange(T - threshold - 1, T - 1, device=input_ids.device)
        tb = None
        targets = input_ids[:, T - threshold:]
    else:
        tb = tail_batch(input_ids, mask, threshold)
        keep, targets = tb.keep, tb.targets
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=keep,
                use_cache=False)
    return (out.logits if tb is None else select_tail_logits(out.logits, tb)), targets


def forward_tail_packed(model: torch.nn.Module, batch: dict[str, Tensor], threshold: int) -> tuple[Tensor, Tensor]:
    """:func:`forward_tail` for a padding-free micro-batch: ``B`` rows packed into one row of ``L`` tokens.

    Calls ``model(input_ids [1, L], position_ids [1, L], logits_to_keep=keep, use_cache=False)`` without an
    attention mask: transformers then reads the packed rows from the restarting position ids and keeps the
    attention inside each row. Row ``b``'s tail is the last ``N`` tokens of its segment.

    Args:
        model: a transformers causal LM.
        batch: ``input_ids [1, L]``, ``position_ids [1, L]``, ``seq_lens [B]`` (every row > ``N`` tokens).
        threshold: ``N``.

    Returns:
        ``(tail_logits [B, N, V], targets [B, N])``.
    """
    input_ids, seq_lens = batch["input_ids"], batch["seq_lens"]
    ends = seq_lens.cumsum(0) - 1                                                      # [B] last token of each row
    tail = ends[:, None] - torch.arange(threshold - 1, -1, -1, device=ends.device)     # [B, N] tail positions
    out = model(input_ids=input_ids, position_ids=batch["position_ids"], logits_to_keep=(tail - 1).reshape(-1),
                use_cache=False)
    B = seq_lens.shape[0]
    return out.logits.reshape(B, threshold, -1), input_ids[0, tail]


@dataclass
class LossSpec:
    """Everything :func:`loss_step` and evaluation need besides the model and the batch (from the config).

    Attributes:
        threshold: ``N`` tail tokens.
        padding_side: ``"left"`` or ``"right"`` (how batches are padded; see :func:`forward_tail`).
        type_weights: weight per ``type_indicator`` id, or ``None`` (every tail token weighs 1).
        criterion: a user criterion (:func:`load_criterion`), or ``None`` for cross-entropy.
        criterion_mode: ``"plain"`` or ``"input"``.
        target_position: which tail token is the label, counted from the end (``-1`` = last).
        label_token_ids: ``[L]`` token id of each label word.
    """

    threshold: int
    padding_side: str
    type_weights: list[float] | None
    criterion: Criterion | None
    criterion_mode: str
    target_position: int
    label_token_ids: Tensor

    @classmethod
    def from_config(cls, cfg: Config, label_token_ids: list[int]) -> LossSpec:
        """Build from the ``loss`` and ``data`` sections. Raises ValueError for a criterion that cannot be imported."""
        return cls(
            threshold=cfg.loss.threshold,
            padding_side=cfg.data.padding_side,
            type_weights=cfg.loss.type_weights,
            criterion=load_criterion(cfg.loss.criterion) if cfg.loss.criterion else None,
            criterion_mode=cfg.loss.criterion_mode,
            target_position=cfg.loss.target_position,
            label_token_ids=torch.tensor(label_token_ids, dtype=torch.long),
        )

    def weights(self, batch: dict[str, Tensor]) -> Tensor:
        """``[B, N]`` tail-token weights of a batch (a user criterion counts every token once)."""
        if self.criterion is not None:
            return torch.ones(batch["input_ids"].shape[0], self.threshold, device=batch["input_ids"].device)
        return token_weights(batch["type_indicator"], self.threshold, self.type_weights)


def loss_step(model: torch.nn.Module, batch: dict[str, Tensor], spec: LossSpec, weights: Tensor) -> Tensor:
    """Forward one micro-batch; return the tail-loss numerator ``[]`` under ``weights`` ``[B, N]``.

    Pure: no collectives; the caller divides by the window's denominator. The tail logits ``[B, N, V]`` are
    freed before returning.
    """
    tail_logits, targets = forward_tail(model, batch, spec.threshold, spec.padding_side)   # [B, N, V], [B, N]
    num, _ = tail_loss(tail_logits, targets, weights, batch["type_indicator"], spec.criterion, spec.criterion_mode)
    return num
