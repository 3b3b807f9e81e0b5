"""The mixture-of-experts part: for a model whose experts are fused 3-D parameters, what LoRA trains in it (the
start-up lines), the tokens each expert receives (``train/expert_load/*``) and, while its routers train, the
load-balancing loss (``loss.router_aux_coef``). None for a dense model. The hooks here are plain tensor code (no
collective: :meth:`ExpertLoad.flush` and :meth:`RouterAux.flush` take the reduction); what a model's experts are is
:mod:`scale.modeling.moe`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from scale.config.schema import Config
from scale.config.validation import ConfigError
from scale.modeling.moe import MoeLayout, load_rewrites, moe_layout, targets_line, text_config
from scale.modeling.moe_lora import path_lines


class ExpertLoad:
    """Counts the tokens each router sends to each expert during training, on device (no host sync until
    :meth:`flush`).

    A forward hook on every router reads its top-k expert indices (the third output of the transformers 5 routers,
    ``(logits [n, E], weights [n, k], indices [n, k])`` for the ``n`` positions of the micro-batch); a pre-hook on the
    model reads the ``attention_mask`` so that padded positions are not counted. Counted only while autograd
    records (training forwards, not evaluation under ``no_grad``) and outside a backward (the recomputation of a
    checkpointed layer would count its tokens twice).

    Args:
        model: the model (peft-wrapped or not), before ``prepare``.
        layout: its :func:`moe_layout`.
        device: where the counts live.
    """

    def __init__(self, model: torch.nn.Module, layout: MoeLayout, device: torch.device) -> None:
        self.num_experts = layout.num_experts
        self.counts = torch.zeros(len(layout.routers), layout.num_experts, dtype=torch.float64, device=device)
        self._mask: torch.Tensor | None = None
        self._handles = []
        modules = dict(model.named_modules())
        prefix = next((p for p in ("base_model.model.", "") if f"{p}{layout.routers[0]}" in modules), "")
        for i, name in enumerate(layout.routers):
            self._handles.append(modules[f"{prefix}{name}"].register_forward_hook(self._hook(i)))
        self._handles.append(model.register_forward_pre_hook(self._read_mask, with_kwargs=True))

    def _read_mask(self, _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask")
        self._mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _hook(self, layer: int) -> Any:
        def count(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return  # evaluation, or the recomputation of a checkpointed layer inside backward
            indices = output[-1] if isinstance(output, tuple) else None
            if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int64, torch.int32):
                return
            idx = indices.reshape(indices.shape[0], -1)  # [n, k]
            mask = self._mask
            weights = None
            if mask is not None and mask.numel() == idx.shape[0]:
                weights = mask.reshape(-1, 1).expand_as(idx).reshape(-1).to(torch.float64)
            self.counts[layer] += torch.bincount(idx.reshape(-1), weights=weights, minlength=self.num_experts)[
                :self.num_experts].to(self.counts)
        return count

    def flush(self, reduce: Any = None) -> dict[str, float]:
        """The interval's ``train/expert_load/*`` metrics, then reset.

        ``tokens/e{i}``: tokens routed to expert ``i``, summed over the MoE layers (a token counts once per expert it
        is sent to); ``min_share`` / ``max_share``: the smallest and largest share of a layer's routed tokens one
        expert received, over all layers (``1/E`` each when balanced; at most ``1/k``, reached when a router sends
        every token to the same ``k`` experts: a collapsed router); ``idle_experts``: (layer, expert) pairs that
        received no token.

        Args:
            reduce: ``tensor -> tensor`` summing over ranks (``accelerator.reduce(t, "sum")``); None: this rank.
        """
        counts = self.counts.clone()
        if reduce is not None:
            counts = reduce(counts)  # collective: every rank calls flush at the same step
        counts = counts.cpu()  # host sync (log interval only)
        self.counts.zero_()
        total = counts.sum(dim=1, keepdim=True)
        if float(total.sum()) == 0:
            return {}
        share = counts / total.clamp_min(1)
        out = {"train/expert_load/min_share": float(share.min()), "train/expert_load/max_share": float(share.max()),
               "train/expert_load/idle_experts": float((counts == 0).sum())}
        width = len(str(self.num_experts - 1))
        for e, n in enumerate(counts.sum(dim=0).tolist()):
            out[f"train/expert_load/tokens/e{e:0{width}d}"] = n
        return out

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


class RouterAux:
    """The model's own load-balancing loss (Switch Transformer, https://arxiv.org/abs/2101.03961, eqs. 4-6; the
    family's ``load_balancing_loss_func`` in transformers) added to the tail loss while the routers train.

    A forward hook on every router keeps its logits ``[n, E]`` of the training forward (not under ``no_grad``, not
    in a checkpointed layer's recomputation); :meth:`term` turns them into ``coef x aux x (the micro-batch's loss
    weights)``, added to the micro-batch's loss numerator: the window's loss ``sum(num) / sum(weights)`` becomes the
    tail CE plus ``coef`` times the weight-averaged aux loss of its micro-batches, the same in every launch mode.

    Args:
        model: the model (peft-wrapped or not), before ``prepare``.
        layout: its :func:`moe_layout`.
        coef: the weight (> 0).
        loss_fn: ``(router logits per layer, E, k, attention_mask [B, T] or None) -> aux []``.
    """

    def __init__(self, model: torch.nn.Module, layout: MoeLayout, coef: float, loss_fn: Any) -> None:
        self.coef, self.loss_fn, self.layout = coef, loss_fn, layout
        self._logits: list[torch.Tensor] = []
        self.sums = torch.zeros(2, dtype=torch.float64)  # aux summed over micro-batches, micro-batches
        modules = dict(model.named_modules())
        prefix = next((p for p in ("base_model.model.", "") if f"{p}{layout.routers[0]}" in modules), "")
        self._handles = [modules[f"{prefix}{name}"].register_forward_hook(self._keep) for name in layout.routers]

    @classmethod
    def for_run(cls, model: torch.nn.Module, layout: MoeLayout | None, coef: float | None,
                train_router: bool) -> RouterAux | None:
        """The aux loss of a run, or None: ``coef`` null means the model config's ``router_aux_loss_coef`` when
        ``train_router``, else none.

        Raises:
            ConfigError: a coefficient > 0 on a dense model, with a frozen router, or for a family without a
                load-balancing loss in transformers.
        """
        if coef is not None and coef < 0:
            raise ConfigError(f"loss.router_aux_coef={coef} must be >= 0 (or null)")
        if coef and layout is None:
            raise ConfigError(f"loss.router_aux_coef={coef} needs a mixture-of-experts model; set it to null")
        if layout is None:
            return None
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if coef is None:
            coef = float(getattr(text_config(base.config), "router_aux_loss_coef", 0.0) or 0.0) if train_router \
                else 0.0
        if not coef:
            return None
        if not train_router:
            raise ConfigError(f"loss.router_aux_coef={coef} balances the routers, which are frozen: set "
                              f"lora.train_router=true, or loss.router_aux_coef=null")
        loss_fn = getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)
        if loss_fn is None:
            raise ConfigError(f"loss.router_aux_coef={coef}: transformers has no load-balancing loss for "
                              f"{layout.family}; set loss.router_aux_coef=null")
        return cls(model, layout, coef, loss_fn)

    def _keep(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        logits = output[0] if isinstance(output, tuple) else output
        self._logits.append(logits)

    def term(self, batch: dict[str, torch.Tensor], weight_sum: torch.Tensor) -> torch.Tensor:
        """``coef x aux x weight_sum`` for the forward just run (its router logits are then dropped).

        Args:
            batch: the micro-batch (its ``attention_mask [B, T]`` keeps padding out of the aux loss).
            weight_sum: the micro-batch's summed loss weights ``[]``.
        """
        logits, self._logits = tuple(self._logits), []
        if not logits:
            return torch.zeros((), device=weight_sum.device)
        mask = batch.get("attention_mask")
        aux = self.loss_fn(logits, self.layout.num_experts, self.layout.top_k,
                           mask if mask is not None and mask.dim() == 2 else None)
        if self.sums.device != aux.device:
            self.sums = self.sums.to(aux.device)
        self.sums += torch.stack([aux.detach().double(), torch.ones((), dtype=torch.float64, device=aux.device)])
        return self.coef * aux.to(weight_sum.dtype) * weight_sum

    def flush(self, reduce: Any = None) -> dict[str, float]:
        """``train/router_aux_loss``: the aux loss averaged over the interval's micro-batches (all ranks), unweighted
        by ``coef``; then reset."""
        sums = self.sums.clone()
        self.sums.zero_()
        if reduce is not None:
            sums = reduce(sums)  # collective: every rank calls flush at the same step
        total, n = sums.tolist()  # host sync (log interval only)
        return {"train/router_aux_loss": total / n} if n else {}


@dataclass
class Experts:
    """What a mixture-of-experts run adds.

    Attributes:
        layout: where the model keeps its experts and routers.
        lines: the start-up lines' parts (what trains; the aux loss' weight).
        load: the tokens-per-expert counter (its :meth:`ExpertLoad.flush` at each log step).
        aux: the load-balancing loss while the routers train, else None.
        warnings: start-up warnings: the installed peft would rewrite the saved adapter's targets on a plain load
            (:func:`scale.modeling.moe.load_rewrites`).
    """

    layout: MoeLayout
    lines: list[str]
    load: ExpertLoad
    aux: RouterAux | None
    warnings: list[str] = field(default_factory=list)


def build_experts(cfg: Config, model: torch.nn.Module, device: torch.device, partitioned: str | None = None
                  ) -> Experts | None:
    """The part for ``model`` (before ``prepare``: the hooks go on its routers), or None for a dense model.

    Args:
        partitioned: the launch mode's name when it shards the weights (``ZeRO-3``, ``FSDP2``): the lines then say
            what each rank gathers.

    Raises:
        ConfigError: ``loss.router_aux_coef`` set on a dense model or with frozen routers (before anything is
            written: :meth:`scale.training.parts.experts.RouterAux.for_run`).
    """
    layout = moe_layout(model)
    aux = RouterAux.for_run(model, layout, cfg.loss.router_aux_coef, cfg.lora.train_router)
    if layout is None:
        return None
    lines = targets_line(model, layout, cfg.lora.dropout, cfg.model.quantize_4bit)
    lines[1:1] = path_lines(model, layout, cfg.lora.expert_impl, partitioned)
    if aux is not None:
        lines.append(f"loss.router_aux_coef={aux.coef:g} (the model's load-balancing loss, added to the loss)")
    rewrites = load_rewrites(model)
    return Experts(layout, lines, ExpertLoad(model, layout, device), aux, [rewrites] if rewrites else [])
