"""What a mixture-of-experts model counts, for the planner and the FLOPs meter: the parameters and FLOPs a token
uses (it runs through ``k`` of the ``E`` routed experts: :func:`active_counts`, :func:`model_shape`), and
transformers' fused-experts kernel run on fake tensors (:func:`static_experts`). The structure itself (which
parameters are experts, what LoRA trains) is :mod:`scale.modeling.moe`'s. No Accelerator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from scale.modeling.moe import MoeLayout, moe_layout, parameter_adapters
from scale.utils import flops


@contextlib.contextmanager
def static_experts() -> Iterator[None]:
    """Run transformers' fused-experts kernel on fake tensors (the planner's activation count,
    :func:`scale.planner.activations.count_activations`).

    transformers 5 computes the experts with ``grouped_mm_experts_forward``: static shapes (a sort of the ``n * k``
    token-expert pairs, ``histc`` offsets), then ``torch.nn.functional.grouped_mm``, whose fake (meta) kernel accepts
    bf16 only ("Expected inputs of BF16 type but got mat_a.dtype=torch.float32"). Its own fallback,
    ``torch.ops.transformers.grouped_mm_fallback``, registers a fake kernel for any dtype and saves the same tensors
    for backward (the sorted input ``[n * k, in]`` and the whole expert weight, with LoRA its ``W + B A``), so
    within this block the fallback is chosen; the count is the real kernel's, whatever the routing (the pairs are
    ``n * k`` in total). Also quiets torch's fake-tensor logger, which prints a traceback per failed op before the
    error it raises.
    """
    import logging

    try:
        import transformers.integrations.moe as moe_kernels
    except ImportError:  # transformers without fused experts
        yield
        return
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    original = getattr(moe_kernels, "_can_use_grouped_mm", None)
    quiet.setLevel(logging.CRITICAL)
    if original is not None:
        moe_kernels._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        quiet.setLevel(level)
        if original is not None:
            moe_kernels._can_use_grouped_mm = original


@dataclass(frozen=True)
class ActiveCounts:
    """Total and per-token (active) elements of a mixture-of-experts model: a token runs through ``k`` of the ``E``
    routed experts of each MoE layer, and through everything else (attention, shared experts, embeddings).

    Attributes:
        total: every parameter (a ZeRO-3 partitioned one at its full size).
        active: what one token uses: ``total - (1 - k/E) x`` the routed experts' weights.
        experts: the routed experts' fused weights (all experts).
        routers: the routers' weights (a matmul per token: ``E x hidden`` each).
        expert_lora: LoRA elements on the routed experts (all experts); ``k/E`` of them are active.
    """

    total: int
    active: int
    experts: int
    routers: int
    expert_lora: int


def active_counts(model: torch.nn.Module, layout: MoeLayout) -> ActiveCounts:
    """Count :class:`ActiveCounts` of ``model`` (plain, peft-wrapped, on the meta device or ZeRO-3 partitioned)."""
    def numel(p: torch.Tensor) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    experts, routers, expert_lora, total, seen = 0, 0, 0, 0, set()
    expert_names, router_names = set(layout.expert_params), set(layout.router_params)
    wrappers = {id(w): n for n, w in parameter_adapters(model).items()}
    for module in model.modules():
        if id(module) in wrappers and wrappers[id(module)] in expert_names:
            for t in list(module.lora_A.parameters()) + list(module.lora_B.parameters()):
                if id(t) not in seen:
                    expert_lora += numel(t)
                    seen.add(id(t))
    for name, p in model.named_parameters(remove_duplicate=True):
        clean = re.sub(r"^base_model\.model\.", "", name).replace(".base_layer", "")
        clean = clean.replace(".parametrizations.", ".").replace(".original", "")
        total += numel(p)
        if clean in expert_names:
            experts += numel(p)
        elif clean in router_names:
            routers += numel(p)
    inactive = (experts + expert_lora) * (layout.num_experts - layout.top_k) // layout.num_experts
    return ActiveCounts(total=total, active=total - inactive, experts=experts, routers=routers,
                        expert_lora=expert_lora)


def model_shape(model: torch.nn.Module) -> flops.ModelShape:
    """:func:`scale.utils.flops.model_shape` with a mixture-of-experts model's fused experts counted as a token uses
    them: ``k/E`` of the routed experts' weights and of their LoRA (``inactive_lora`` holds the rest of it), the
    routers' ``[E, H]`` matmuls in full. A dense model's shape is :func:`scale.utils.flops.model_shape`'s."""
    shape = flops.model_shape(model)
    layout = moe_layout(model)
    if layout is None:
        return shape
    counts = active_counts(model, layout)
    inactive = layout.num_experts - layout.top_k
    return dataclasses.replace(shape, layers=shape.layers + counts.experts * layout.top_k // layout.num_experts
                               + counts.routers,
                               inactive_lora=counts.expert_lora * inactive // layout.num_experts)
