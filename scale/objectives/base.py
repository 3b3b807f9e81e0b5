"""What an objective is to the loop: one small interface (:class:`Objective`). Plain tensors only.

The loop never branches on the objective: it asks each micro-batch for its :meth:`Objective.weights`, sums them over
the whole accumulation window and every rank (the loss denominator), and divides the sum of
:meth:`Objective.loss_step` numerators by it once (the token-weighted normalization of torchtune and transformers).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class Objective(Protocol):
    """One training objective (the ``loss.objective`` value :attr:`name`), built by
    :func:`scale.objectives.build_objective`.

    An objective may also define ``metrics(...)``: summed per-micro-batch metric terms the meter averages (a
    preference objective's rewards); the tail loss has none.
    """

    @property
    def name(self) -> str:
        """The ``loss.objective`` value (``"sft"``)."""
        ...

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """The keys a batch must carry for :meth:`weights` and :meth:`loss_step`."""
        ...

    def weights(self, batch: dict[str, Tensor]) -> Tensor:
        """The units whose sum over a whole accumulation window (all ranks) is the loss denominator: ``[B, N]``
        tail-token weights for the tail loss, one per pair for a pair objective. Float32."""
        ...

    def loss_step(self, model: torch.nn.Module, batch: dict[str, Tensor], weights: Tensor) -> Tensor:
        """Forward one micro-batch; return its loss numerator ``[]`` (the sum of the terms under ``weights``).
        Pure: no collectives; the loop divides by the window's denominator."""
        ...
