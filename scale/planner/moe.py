"""What the plan says of a mixture-of-experts model: the base model's parameters and those a token uses, what the
LoRA adapter adds, the training FLOPs per token from the active ones, and the expert stack one layer holds
(:func:`moe_text`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from scale.modeling.moe import active_counts, moe_layout
from scale.modeling.moe import model_shape as moe_model_shape
from scale.planner.census import GIB, nbytes
from scale.utils.flops import flops_per_token

def moe_text(model: torch.nn.Module, params: list[Any], max_length: int, threshold: int) -> str:
    """The plan's line for a mixture-of-experts model (``""`` for a dense one): the base model's parameters and those
    a token uses (it runs through ``k`` of the ``E`` routed experts, :func:`scale.modeling.moe.active_counts`: the
    counts a model card gives), what the LoRA adapter adds (all of it, and the part a token uses), the training FLOPs
    per token from the active ones (:func:`scale.modeling.moe.model_shape`, the ``train/mfu`` count) against every
    expert running, and the expert stack one MoE layer holds in its training dtype: LoRA on fused experts (peft's
    ``ParamWrapper``) computes ``W + B A`` for the whole stack in each forward, which backward keeps (counted in the
    saved activations; checkpointing keeps one layer's)."""
    layout = moe_layout(model)
    if layout is None:
        return ""
    counts = active_counts(model, layout)
    trainable = sum(p.numel for p in params if p.trainable)
    shape = moe_model_shape(model)
    fraction = threshold / max_length
    active = flops_per_token(shape, max_length, lora_params=trainable, logits_fraction=fraction)
    every = flops_per_token(replace(shape, layers=shape.layers + counts.experts - counts.experts * layout.top_k
                                    // layout.num_experts, inactive_lora=0), max_length, lora_params=trainable,
                            logits_fraction=fraction)
    by_name = {p.name.removeprefix("base_model.model.").replace(".base_layer", ""): p for p in params}
    stack = max((sum(by_name[n].numel * nbytes(by_name[n].dtype) for n in layout.expert_params
                     if n.startswith(f"{e}.") and n in by_name) for e in layout.experts), default=0)
    base = counts.total - trainable
    base_active = base - counts.experts * (layout.num_experts - layout.top_k) // layout.num_experts
    return (f"mixture of experts: {layout.num_experts} routed experts, top-{layout.top_k}, in {len(layout.experts)} "
            f"layers: {base:,} base parameters, {base_active:,} active per token ({base_active / base:.1%}); the "
            f"LoRA adapter adds {trainable:,} ({counts.active - base_active:,} active); training FLOPs per token "
            f"{active:.3g} from the active ones (train/mfu counts these; {every:.3g} if every expert ran); one "
            f"layer's expert stack {stack / GIB:.2f} GiB, computed as W + B A in each forward (LoRA on fused experts) "
            f"and kept for backward")

