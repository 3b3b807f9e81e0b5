"""A mixture-of-experts model's load-balancing loss on top of any objective, while its routers train.

``job.setup`` wraps the objective ``loss.objective`` names (:func:`with_router_aux`); the loop sees one objective and
never branches on it. The router logits come from hooks on the model's routers
(:class:`scale.training.parts.experts.RouterAux`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from scale.objectives.base import Objective


class WithRouterAux:
    """``objective`` whose :meth:`loss_step` numerator also holds ``coef x aux x sum(weights)``: the window's loss
    (numerators over the window's summed weights) becomes the objective's loss plus ``coef`` times the weight-averaged
    load-balancing loss of its micro-batches, the same in every launch mode (transformers' MoE models add
    ``router_aux_loss_coef x aux_loss`` to their loss the same way, per forward). Everything else is the objective's.

    Args:
        objective: the wrapped objective.
        aux: what gives a micro-batch's term after its forward: ``term(batch, weight_sum) -> []``
            (:class:`scale.training.parts.experts.RouterAux`).
    """

    def __init__(self, objective: Objective, aux: Any) -> None:
        self.objective = objective
        self.aux = aux

    def __getattr__(self, name: str) -> Any:
        if name in ("objective", "aux"):  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.objective, name)

    def loss_step(self, model: torch.nn.Module, batch: dict[str, Tensor], weights: Tensor) -> Tensor:
        """The objective's numerator ``[]`` plus this micro-batch's load-balancing term (zero when its forward kept
        no router logits: evaluation, or a forward without routers)."""
        return self.objective.loss_step(model, batch, weights) + self.aux.term(batch, weights.sum())


def with_router_aux(objective: Objective, aux: Any | None) -> Objective:
    """``objective`` with the load-balancing loss of ``aux`` added, or ``objective`` itself when ``aux`` is None."""
    return objective if aux is None else WithRouterAux(objective, aux)
