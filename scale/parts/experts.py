"""The mixture-of-experts part: for a model whose experts are fused 3-D parameters, what LoRA trains in it (the
start-up lines), the tokens each expert receives (``train/expert_load/*``) and, while its routers train, the
load-balancing loss (``loss.router_aux_coef``). None for a dense model. See :mod:`scale.moe`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scale.moe import ExpertLoad, MoeLayout, RouterAux, moe_layout, targets_line
from scale.schema import Config


@dataclass
class Experts:
    """What a mixture-of-experts run adds.

    Attributes:
        layout: where the model keeps its experts and routers.
        lines: the start-up lines' parts (what trains; the aux loss' weight).
        load: the tokens-per-expert counter (its :meth:`~scale.moe.ExpertLoad.flush` at each log step).
        aux: the load-balancing loss while the routers train, else None.
    """

    layout: MoeLayout
    lines: list[str]
    load: ExpertLoad
    aux: RouterAux | None


def build_experts(cfg: Config, model: torch.nn.Module, device: torch.device) -> Experts | None:
    """The part for ``model`` (before ``prepare``: the hooks go on its routers), or None for a dense model.

    Raises:
        ConfigError: ``loss.router_aux_coef`` set on a dense model or with frozen routers (before anything is
            written: :meth:`scale.moe.RouterAux.for_run`).
    """
    layout = moe_layout(model)
    aux = RouterAux.for_run(model, layout, cfg.loss.router_aux_coef, cfg.lora.train_router)
    if layout is None:
        return None
    lines = targets_line(model, layout, cfg.lora.dropout, cfg.model.quantize_4bit)
    if aux is not None:
        lines.append(f"loss.router_aux_coef={aux.coef:g} (the model's load-balancing loss, added to the loss)")
    return Experts(layout, lines, ExpertLoad(model, layout, device), aux)
