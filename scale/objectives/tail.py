"""The ``sft`` objective: cross-entropy over each row's tail (:mod:`scale.loss`), chunked where the tail's logits
would not fit at once (:mod:`scale.loss.chunked`). Plain tensors only.

Shapes: ``B`` rows, ``N`` the longest tail of the batch, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from scale.config.schema import Config
from scale.loss import tail as scale_loss  # module attribute: tests spy on scale.loss.tail.forward_tail
from scale.loss.chunked import chunkable, chunked_tail_loss, forward_tail_hidden, resolve_chunk_size, vocab_size
from scale.loss.tail import CRITERION_MODE, Criterion, load_criterion, token_weights

BATCH_KEYS = ("input_ids", "attention_mask", "tail_mask", "type_indicator")
"""What a padded batch carries for the tail loss (:class:`scale.data.collate.Collator`)."""


@dataclass
class LossSpec:
    """What the tail loss reads besides the model and the batch (from the config): how the batches are padded,
    how tokens are weighted, the criterion and how the loss is chunked. What evaluation adds per data format is the
    split's task (:class:`scale.data.tasks.base.Task`), not this.

    Attributes:
        padding_side: ``"left"`` or ``"right"`` (how batches are padded; see :func:`forward_tail`).
        type_weights: weight per ``type_indicator`` id, or ``None`` (every tail token weighs 1).
        criterion: a user criterion (:func:`load_criterion`: it takes the type ids whatever ``loss.criterion_mode``
            says), or ``None`` for cross-entropy.
        chunk_size: ``loss.chunk_size``: ``"auto"``, 0 (unchunked) or positions per chunk of the tail loss
            (:mod:`scale.loss.chunked`); ``"liger"`` under ``loss.fused: liger`` (chunks where ``auto`` would, with
            Liger-Kernel's fused linear cross-entropy).
    """

    padding_side: str = "left"
    type_weights: list[float] | None = None
    criterion: Criterion | None = None
    chunk_size: int | str = "auto"

    @classmethod
    def from_config(cls, cfg: Config) -> LossSpec:
        """Build from the ``loss`` and ``data`` sections.

        Args:
            cfg: the run's config.

        Raises:
            ValueError: a criterion that cannot be imported.
        """
        return cls(
            padding_side=cfg.data.padding_side,
            type_weights=cfg.loss.type_weights,
            criterion=load_criterion(cfg.loss.criterion, cfg.loss.criterion_mode) if cfg.loss.criterion else None,
            chunk_size="liger" if cfg.loss.fused == "liger" else cfg.loss.chunk_size,
        )

    def weights(self, batch: dict[str, Tensor]) -> Tensor:
        """``[B, N]`` tail-token weights of a batch (a user criterion counts every trained tail token once)."""
        if self.criterion is not None:
            return batch["tail_mask"].float()
        return token_weights(batch["type_indicator"], batch["tail_mask"], self.type_weights)

    @property
    def name(self) -> str:
        """The ``loss.objective`` value this objective answers to."""
        return "sft"

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """What a batch must carry (:mod:`scale.data.collate`; a sequence-parallel shard carries more)."""
        return BATCH_KEYS

    def tail_loss(self, tail_logits: Tensor, targets: Tensor, weights: Tensor,
                  type_indicator: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`scale.loss.tail.tail_loss` under this spec's criterion: ``(numerator, denominator)``, float32 scalars
        ``[]``."""
        return scale_loss.tail_loss(tail_logits, targets, weights, type_indicator, self.criterion, CRITERION_MODE)

    def loss_step(self, model: torch.nn.Module, batch: dict[str, Tensor], weights: Tensor) -> Tensor:
        """Forward one micro-batch; return the tail-loss numerator ``[]`` under ``weights`` ``[B, N]``.

        Pure: no collectives; the caller divides by the window's denominator. The rows were checked by
        ``scale.train.windows`` (inside its all-gather), so no check here. The tail logits ``[B, N, V]`` are
        freed before returning; when ``chunk_size`` cuts the tail into several chunks they are never built at
        once (:func:`scale.loss.chunked.chunked_tail_loss`: fp32 logits of one chunk at a time, exact to round-off),
        else the loss is :func:`scale.loss.tail.tail_loss` of the tail logits.
        """
        B, N = weights.shape
        if chunkable(model):
            chunk = resolve_chunk_size(self.chunk_size, B * N, vocab_size(model))
            if chunk:
                hidden, targets = forward_tail_hidden(model, batch, padding_side=self.padding_side, check=False)
                num, _ = chunked_tail_loss(model, hidden, targets, weights, chunk, batch["type_indicator"],
                                           self.criterion, CRITERION_MODE,
                                           fused="liger" if self.chunk_size == "liger" else None)
                return num
        tail_logits, targets = scale_loss.forward_tail(model, batch, padding_side=self.padding_side, check=False)
        num, _ = self.tail_loss(tail_logits, targets, weights, batch["type_indicator"])
        return num
