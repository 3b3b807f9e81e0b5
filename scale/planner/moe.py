"""What the plan says of a mixture-of-experts model: the base model's parameters and those a token uses, what the
LoRA adapter adds, the training FLOPs per token from the active ones, the expert stack one layer holds and what one
MoE layer's forward and backward add on either expert LoRA path (:func:`count_moe_layer`, :func:`moe_text`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from scale.config.schema import Config
from scale.modeling.moe import moe_layout, text_config
from scale.modeling.moe_counts import active_counts, static_experts
from scale.modeling.moe_counts import model_shape as moe_model_shape
from scale.modeling.moe_lora import is_split, layout_problem_of, on_path
from scale.modeling.split_experts import force_loop
from scale.planner.activations import PeakBytes, _fake_parameters, four_bit_layers, trained_dtypes
from scale.planner.census import DTYPES, GIB, ParamInfo, PlanError, nbytes
from scale.utils.flops import flops_per_token


def experts_path(model: torch.nn.Module) -> str | None:
    """``split`` or ``peft``: the path the experts' LoRA of the (meta) model's first MoE layer takes; None for a
    dense model or experts without LoRA."""
    layout = moe_layout(model)
    if layout is None:
        return None
    modules = dict(model.named_modules())
    outer = modules.get(f"base_model.model.{layout.experts[0]}", modules.get(layout.experts[0]))
    return None if not hasattr(outer, "base_layer") else "split" if is_split(outer) else "peft"


def count_moe_layer(cfg: Config, model: torch.nn.Module, params: list[ParamInfo], cast: torch.dtype | None = None
                    ) -> dict[str, int]:
    """Peak bytes one MoE layer's block (router and experts) adds during its forward and backward over one
    micro-batch, on each expert LoRA path it can take: ``{"split": ..., "peft": ...}`` (the path of
    ``lora.expert_impl`` and the other; empty for a dense model or experts without LoRA).

    The model's first MoE block runs on fake tensors as :func:`scale.planner.activations.count_activations` runs the
    whole model (its dtypes, 4-bit layers, autocast), on ``train.micro_batch_size x data.max_length`` tokens whose
    hidden states need a gradient (a layer inside the model), then backward from ``sum(out * g)``; every storage an
    op creates is followed until it is freed (:class:`scale.planner.activations.PeakBytes`). Counted: the routed
    pairs' activations, the gate's and the adapters' products and, on peft's path, ``W + B A`` for the whole stack
    and its gradient; not counted: the block's weights, its input and ``g`` (``benchmarks/moe_experts.py`` measures
    the same on real tensors).

    Raises:
        PlanError: the block cannot run on fake tensors.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout = moe_layout(model)
    if layout is None:
        return {}
    modules = dict(model.named_modules())
    prefix = next((p for p in ("base_model.model.", "") if f"{p}{layout.experts[0]}" in modules), "")
    outer = modules[f"{prefix}{layout.experts[0]}"]
    if not hasattr(outer, "base_layer"):
        return {}  # no LoRA on the experts
    block = modules[f"{prefix}{layout.experts[0].rpartition('.')[0]}"]
    dtype_of, quantized = trained_dtypes(model, params, cast)
    B, T = cfg.train.micro_batch_size, cfg.data.max_length
    hidden = text_config(model.config).hidden_size
    autocast = cfg.train.mixed_precision != "no" and cast is None
    amp_dtype = torch.bfloat16 if cfg.train.mixed_precision == "bf16" else torch.float16
    compute = DTYPES.get(cfg.model.bnb_4bit_compute_dtype, amp_dtype if autocast else torch.float32)
    paths = ["split", "peft"] if is_split(outer) else ["peft"] + ([] if layout_problem_of(outer) else ["split"])
    out: dict[str, int] = {}
    for impl in paths:
        mode = FakeTensorMode()
        try:
            with _fake_parameters(model, mode, dtype_of), four_bit_layers(model, quantized, compute), mode, \
                    static_experts(), force_loop(), on_path(outer, impl):
                dtype = model.get_input_embeddings().weight.dtype  # the residual stream's
                x = torch.zeros(B, T, hidden, dtype=dtype, requires_grad=True)
                g = torch.zeros(B, T, hidden)
                peak = PeakBytes(*model.parameters(), *model.buffers(), x, g)
                with torch.autocast("cpu", dtype=amp_dtype, enabled=autocast), peak:
                    y = block(x)
                    loss = ((y[0] if isinstance(y, tuple) else y).float() * g).sum()
                    del y  # in the model the residual add consumes the block's output: not kept for backward
                    loss.backward()
                out[impl] = peak.peak
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            raise PlanError(f"cannot count a MoE layer of model type {model.config.model_type!r} on fake tensors "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    return out


def moe_text(model: torch.nn.Module, params: list[Any], max_length: int, threshold: int,
             layer: dict[str, int] | None = None) -> str:
    """The plan's line for a mixture-of-experts model (``""`` for a dense one): the base model's parameters and those
    a token uses (it runs through ``k`` of the ``E`` routed experts, :func:`scale.modeling.moe_counts.active_counts`: the
    counts a model card gives), what the LoRA adapter adds (all of it, and the part a token uses), the training FLOPs
    per token from the active ones (:func:`scale.modeling.moe_counts.model_shape`, the ``train/mfu`` count) against every
    expert running, the expert stack one MoE layer holds in its training dtype and what the experts' LoRA path does
    with it (``lora.expert_impl``: split reads it in place; peft's ``ParamWrapper`` computes ``W + B A`` for the whole
    stack in each forward, which backward keeps), with what one MoE layer's forward and backward add on each path
    (``layer``: :func:`count_moe_layer`), and what ZeRO-3 / FSDP2 gather."""
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
    layer = layer or {}
    impl = experts_path(model)
    if impl == "split":
        path = ("read in place by the split expert LoRA (lora.expert_impl): x W_e + alpha/r (x A_e) B_e on the "
                "routed tokens")
    elif impl == "peft":
        path = "computed as W + B A in each forward (LoRA on fused experts, peft's path) and kept for backward"
    else:
        path = "no LoRA on the experts"
    peaks = "; ".join(f"{name} {layer[name] / GIB:.2f} GiB" for name in ("split", "peft") if name in layer)
    return (f"mixture of experts: {layout.num_experts} routed experts, top-{layout.top_k}, in {len(layout.experts)} "
            f"layers: {base:,} base parameters, {base_active:,} active per token ({base_active / base:.1%}); the "
            f"LoRA adapter adds {trainable:,} ({counts.active - base_active:,} active); training FLOPs per token "
            f"{active:.3g} from the active ones (train/mfu counts these; {every:.3g} if every expert ran); one "
            f"layer's expert stack {stack / GIB:.2f} GiB, {path}"
            + (f"; one MoE layer's forward + backward adds at its peak: {peaks}" if peaks else "")
            + "; ZeRO-3 / FSDP2: every rank gathers each MoE layer's whole stack for its forward and again for "
              "backward")
