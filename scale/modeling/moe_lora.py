"""Split expert LoRA behind peft's adapter: which path computes a mixture-of-experts model's experts
(``lora.expert_impl``), and what the start-up lines say of it. No Accelerator.

peft's ``ParamWrapper`` modules (one per adapted fused weight, nested around the experts module) keep the adapter's
parameters, names, state dict, merge and unload; the outermost of them changes class to a subclass whose forward is
:func:`scale.modeling.split_experts.split_experts_forward` with the chain's LoRA factors (:func:`use_split`), as
torch's ``fully_shard`` gives a module its FSDP class. ``lora.expert_impl`` chooses (:func:`choose_path`), the
start-up lines say what each path keeps and what ZeRO-3 / FSDP2 gather (:func:`path_lines`), and the planner counts
either path on the same model (:func:`on_path`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from scale.config.validation import ConfigError
from scale.modeling.moe import MoeLayout, expert_factors, is_parameter_adapter, parameter_adapters
from scale.modeling.split_experts import ExpertFactors, layout_problem, split_experts_forward


def _chain(outer: torch.nn.Module) -> list[torch.nn.Module]:
    """peft's nested ``ParamWrapper`` modules from ``outer`` inwards (one per adapted weight of the module under
    them, ``chain[-1].base_layer``)."""
    chain = [outer]
    while is_parameter_adapter(chain[-1].base_layer):
        chain.append(chain[-1].base_layer)
    return chain


def _split_class() -> type:
    """peft's ``ParamWrapper`` with the split forward (built once, on first use: peft is imported lazily)."""
    global _SPLIT
    if _SPLIT is not None:
        return _SPLIT
    from peft.tuners.lora.layer import ParamWrapper

    class SplitExpertsLora(ParamWrapper):
        """The outermost of the ``ParamWrapper`` chain peft builds around an experts module (one per adapted fused
        weight, nested), computing the experts with :func:`split_experts_forward` and the chain's LoRA factors.
        Same parameters, names, state dict, merge and unload as peft's; peft's own forward (``W + B A`` folded into
        the weight) runs when an adapter is disabled or merged, when several adapters are active, and when the
        call carries arguments other than the experts' three."""

        def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            chain = _chain(self)
            if len(args) != 2 or kwargs or any(w.disable_adapters or w.merged for w in chain):
                return super().forward(hidden_states, *args, **kwargs)
            adapters: dict[str, ExpertFactors] = {}
            for w in chain:
                active = [a for a in w.active_adapters if a in w.lora_A]
                if len(active) > 1:
                    return super().forward(hidden_states, *args, **kwargs)
                if active:
                    a, b = expert_factors(w, active[0])
                    adapters[w.parameter_name] = ExpertFactors(a, b, w.scaling[active[0]])
            return split_experts_forward(chain[-1].base_layer, hidden_states, args[0], args[1], adapters)

    _SPLIT = SplitExpertsLora
    return _SPLIT


_SPLIT: type | None = None


def is_split(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes its experts with the split path (:func:`use_split`)."""
    return _SPLIT is not None and isinstance(module, _SPLIT)


def use_split(model: torch.nn.Module, experts: list[str]) -> dict[str, str]:
    """Switch the experts modules named ``experts`` (``model.layers.0.mlp.experts``, as
    :attr:`scale.modeling.moe.MoeLayout.experts`) of a peft model to the split path, in place; parameters untouched.

    Returns:
        The modules left on peft's path, by name, with the reason (:func:`layout_problem`; or no adapter on its
        weights).
    """
    from peft.tuners.lora.layer import ParamWrapper

    split = _split_class()
    modules = dict(model.named_modules())
    prefix = next((p for p in ("base_model.model.", "") if f"{p}{experts[0]}" in modules), "") if experts else ""
    left: dict[str, str] = {}
    for name in experts:
        outer = modules[f"{prefix}{name}"]
        if not isinstance(outer, ParamWrapper):
            left[name] = "no LoRA on its weights"
            continue
        chain = _chain(outer)
        problem = layout_problem(chain[-1].base_layer, [w.parameter_name for w in chain])
        if problem:
            left[name] = problem
        elif type(outer) is ParamWrapper:
            outer.__class__ = split  # as torch's fully_shard gives a module its FSDP class: the state stays
    return left


@contextlib.contextmanager
def on_path(outer: torch.nn.Module, impl: str) -> Iterator[None]:
    """Within this block the experts module under ``outer`` (peft's outermost wrapper of it) runs on ``impl``
    (``split`` | ``peft``), whatever its path outside: what the planner counts both paths with. Parameters
    untouched.

    Raises:
        ValueError: ``split`` for a module the split path cannot compute (:func:`layout_problem_of`).
    """
    from peft.tuners.lora.layer import ParamWrapper

    if impl == "split" and (problem := layout_problem_of(outer)):
        raise ValueError(f"the split path cannot compute this experts module: {problem}")
    before = type(outer)
    outer.__class__ = _split_class() if impl == "split" else ParamWrapper
    try:
        yield
    finally:
        outer.__class__ = before


def choose_path(model: torch.nn.Module, experts: list[str], impl: str | None) -> dict[str, str]:
    """Apply ``lora.expert_impl`` to a peft model's experts modules (``experts``: their names): ``split`` or null
    switch every module the split path can compute (:func:`use_split`), ``peft`` leaves them all on peft's path.

    Returns:
        The modules on peft's path, by name, with the reason (``lora.expert_impl=peft``, or why the split path
        cannot take them: :func:`layout_problem`).

    Raises:
        ConfigError: ``lora.expert_impl=split`` and a module the split path cannot compute (one line: the module,
            the reason, the fix).
    """
    if impl == "peft":
        return {name: "lora.expert_impl=peft" for name in experts}
    left = use_split(model, experts)
    if impl == "split" and left:
        name, reason = next(iter(left.items()))
        raise ConfigError(f"lora.expert_impl=split cannot compute {name}: {reason}; set lora.expert_impl=peft (or "
                          f"null: split where it can, peft's path elsewhere)")
    return left


def path_lines(model: torch.nn.Module, layout: MoeLayout, impl: str | None, partitioned: str | None) -> list[str]:
    """The start-up lines of the experts' LoRA path (parts to join with ``"; "``): which path computes the experts
    and what it keeps, and under ZeRO-3 / FSDP2 (``partitioned``: the mode's name, else None) what each rank
    gathers."""
    modules = dict(model.named_modules())
    prefix = next((p for p in ("base_model.model.", "") if f"{p}{layout.experts[0]}" in modules), "")
    split = [n for n in layout.experts if is_split(modules[f"{prefix}{n}"])]
    adapted = {n.rsplit(".", 1)[0] for n in parameter_adapters(model)}
    peft = [n for n in layout.experts if n not in split and n in adapted]
    lines = []
    if split:
        lines.append(f"experts' LoRA split{' (lora.expert_impl=split)' if impl == 'split' else ''}: x W_e + "
                     f"alpha/r (x A_e) B_e on the tokens routed to each expert, W + B A never formed"
                     f"{f' ({len(split)} of {len(layout.experts)} MoE layers)' if peft else ''}")
    if peft:
        reason = ("lora.expert_impl=peft" if impl == "peft" else
                  f"the split path does not know their layout: {layout_problem_of(modules[f'{prefix}{peft[0]}'])}")
        lines.append(f"experts' LoRA on peft's path in {len(peft)} of {len(layout.experts)} MoE layers ({reason}): "
                     f"W + B A for each layer's whole expert stack in each forward, kept for backward")
    if partitioned and (split or peft):
        params = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p
                  for n, p in model.named_parameters()}
        stack = max(sum(int(getattr(params[n], "ds_numel", params[n].numel())) * params[n].element_size()
                        for n in layout.expert_params if n.startswith(f"{e}.") and n in params) for e in layout.experts)
        size = f"{stack / 2**30:.2f} GiB" if stack >= 2**30 else f"{stack / 2**20:.3g} MiB"
        lines.append(f"{partitioned}: every rank gathers each MoE layer's whole expert stack ({size}) for its forward "
                     f"and again for backward (only expert parallelism, which scale does not run, would gather a "
                     f"share){'; peft adds W + B A and its gradient' if peft else ''}")
    return lines


def layout_problem_of(outer: torch.nn.Module) -> str | None:
    """:func:`layout_problem` of the experts module under ``outer`` (peft's outermost wrapper of it)."""
    chain = _chain(outer)
    return layout_problem(chain[-1].base_layer, [w.parameter_name for w in chain])
