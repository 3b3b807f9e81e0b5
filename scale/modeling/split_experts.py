"""The split experts forward: a mixture-of-experts layer's experts with LoRA on their fused weights computed as
``y = x W_e + s (x A_e^T) B_e^T`` on the tokens routed to expert ``e`` only, never ``W + B A``. Plain tensor code:
no peft, no Accelerator (:mod:`scale.modeling.moe_lora` puts it behind peft's adapter modules).

peft's ``ParamWrapper`` adapts a fused expert weight ``W [E, out, in]`` by adding ``s B A`` to the whole stack
(``torch.baddbmm`` over all ``E`` experts) before transformers' experts kernel reads it; backward then keeps that
stack and computes its full gradient, although a token visits ``k`` of the ``E`` experts. Here the same parameters
(peft's ``lora_A [r E, in]`` and ``lora_B [out, r E]``, :func:`scale.modeling.moe.expert_factors`) are applied as two
small grouped products on the token-expert pairs sorted by expert, beside the base's grouped product (the split LoRA of
unsloth's MoE kernels and of ScatterMoE's LoRA, https://github.com/shawntan/scattermoe):

    pairs sorted by expert     x_g [S, in]            (S = tokens x k)
    base                       x_g W_e^T              grouped_mm(x_g, W^T, offs)         frozen: no weight gradient
    adapter                    s (x_g A_e^T) B_e^T    grouped_mm(grouped_mm(x_g, A^T), B^T), [S, r] in between

so forward and backward hold the routed pairs' activations plus ``[S, r]``, and the frozen stack is only read.

:func:`grouped_mm` runs ``torch.nn.functional.grouped_mm`` (transformers' ``grouped_mm`` experts kernel) where it
applies, else a per-expert loop (as transformers' own fallback, ``transformers.integrations.moe._grouped_mm_fallback``)
that computes only the gradients autograd asks for: transformers' fallback always builds the weight gradient, a
stack-sized tensor for a frozen base. :func:`split_experts_forward` is transformers 5's ``grouped_mm_experts_forward``
(``transformers/integrations/moe.py``) with the adapters added to the two projections; it serves every experts class
decorated with transformers' ``use_experts_implementation`` (gated or not, ``[E, out, in]`` or transposed
``[E, in, out]`` storage, biases, a post-expert norm, its own ``_apply_gate``): :func:`layout_problem` says why a
module is not one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# Where torch's native grouped GEMM takes the operands: dtypes (its CPU and CUDA kernels), and 16-byte aligned
# pointers and strides ("strides should be multiple of 16 bytes", torch/_meta_registrations.py _grouped_mm checks).
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FORCE_LOOP = [False]  # set by force_loop(): the planner's fake-tensor count (the native fake kernel takes bf16 only)


@torch.library.custom_op("scale::grouped_mm_loop", mutates_args=())
def _grouped_mm_loop(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[S, in] x [E, in, out] -> [S, out]``: rows ``offs[e-1]:offs[e]`` times ``weight[e]``; one host sync."""
    out = input.new_zeros(input.shape[0], weight.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(input[start:end], weight[e], out=out[start:end])
        start = end
    return out


@_grouped_mm_loop.register_fake
def _grouped_mm_loop_fake(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return input.new_empty(input.shape[0], weight.shape[2])


@torch.library.custom_op("scale::grouped_mm_loop_weight_grad", mutates_args=())
def _grouped_mm_loop_weight_grad(input: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor,
                                 experts: int) -> torch.Tensor:
    """``[E, in, out]``: ``input[rows of e]^T grad[rows of e]`` per expert, zero for an expert without rows."""
    out = input.new_zeros(experts, input.shape[1], grad.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(input[start:end].T, grad[start:end], out=out[e])
        start = end
    return out


@_grouped_mm_loop_weight_grad.register_fake
def _grouped_mm_loop_weight_grad_fake(input: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor,
                                      experts: int) -> torch.Tensor:
    return input.new_empty(experts, input.shape[1], grad.shape[1])


def _loop_setup(ctx, inputs, output) -> None:
    input, weight, offs = inputs
    # keep what the gradients asked for need, as the native kernel's autograd does (a frozen weight: only weight)
    ctx.save_for_backward(input if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None,
                          offs)
    ctx.experts = weight.shape[0]


def _loop_backward(ctx, grad: torch.Tensor):
    input, weight, offs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_input = _grouped_mm_loop(grad, weight.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_weight = _grouped_mm_loop_weight_grad(input, grad, offs, ctx.experts) if ctx.needs_input_grad[1] else None
    return grad_input, grad_weight, None


_grouped_mm_loop.register_autograd(_loop_backward, setup_context=_loop_setup)


@contextlib.contextmanager
def force_loop() -> Iterator[None]:
    """Within this block :func:`grouped_mm` takes the per-expert loop, whose fake kernel takes any dtype (the
    planner's fake-tensor counts; torch's native fake kernel takes bf16 only). It saves what the native kernel saves
    for backward."""
    before = _FORCE_LOOP[0]
    _FORCE_LOOP[0] = True
    try:
        yield
    finally:
        _FORCE_LOOP[0] = before


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or (s * size) % 16 == 0 for s in t.stride())


def native_grouped_mm(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` runs torch's grouped GEMM on these operands: torch has it (2.9+ on CPU; on CUDA
    compute capability 8.0+, the condition of transformers' ``_can_use_grouped_mm``), the dtype is one it takes, and
    every pointer and stride is 16-byte aligned, the output's rows too (backward multiplies by its gradient);
    otherwise the per-expert loop."""
    if _FORCE_LOOP[0] or input.dtype != weight.dtype or input.dtype not in NATIVE_DTYPES:
        return False
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None or input.device.type not in ("cpu", "cuda"):
        return False
    if input.device.type == "cuda" and torch.cuda.get_device_capability(input.device) < (8, 0):
        return False
    if input.device.type == "cpu" and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 9):
        return False  # no CPU kernel before torch 2.9 (pytorch/pytorch#172440)
    # the output [S, out] and its gradient too: the backward's products take them as operands
    return _aligned(input) and _aligned(weight) and (weight.shape[-1] * weight.element_size()) % 16 == 0


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped product: rows ``offs[e-1]:offs[e]`` of ``input`` times ``weight[e]``.

    Args:
        input: ``[S, in]``, rows sorted by expert.
        weight: ``[E, in, out]`` (a transposed view is fine).
        offs: ``[E]`` int32, the cumulative row counts (``offs[-1] == S``).

    Returns:
        ``[S, out]`` in ``input``'s dtype. Gradients flow to ``input`` and ``weight`` as autograd asks; a frozen
        ``weight`` gets none computed, and the input is then not kept for backward.
    """
    if native_grouped_mm(input, weight):
        fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
        return fn(input, weight, offs=offs)
    return _grouped_mm_loop(input, weight, offs)


class _ZeroIdle(torch.autograd.Function):
    """Identity on an expert-indexed ``[E, ...]`` factor whose gradient is set to exactly zero for the experts that
    received no token: torch's grouped GEMM gives empty groups non-zero weight gradients on some GPUs
    (pytorch/pytorch#172439, Blackwell), and an idle expert's adapter must not move."""

    @staticmethod
    def forward(ctx, factor: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(routed)
        return factor.view_as(factor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (routed,) = ctx.saved_tensors
        mask = routed.view(-1, *([1] * (grad.dim() - 1)))
        return torch.where(mask, grad, torch.zeros((), dtype=grad.dtype, device=grad.device)), None


@dataclass
class ExpertFactors:
    """One fused weight's LoRA pairs, expert by expert (views of peft's ``lora_A`` / ``lora_B``).

    Attributes:
        a: ``[E, r, in]``, expert ``e``'s ``A_e``.
        b: ``[E, out, r]``, expert ``e``'s ``B_e``.
        scaling: ``alpha / r`` (peft's ``scaling``; ``alpha / sqrt(r)`` with rsLoRA).
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


class _BaseAndDown(torch.autograd.Function):
    """One projection's two products on the sorted pairs ``x [S, in]``: the base ``x W_e^T`` and the adapter's
    first, ``u = x A_e^T`` (``w_t``, ``a_t``: ``[E, in, out]``, ``[E, in, r]``), as one autograd node, so that
    backward sums the two contributions to ``x``'s gradient into one ``[S, in]`` tensor (autograd would hold both
    and their sum). Given ``(source, rows)`` with ``x = source[rows]``, it keeps those for backward instead of
    ``x`` (``k`` times the tokens) and gathers ``x`` again there (ScatterMoE's trick of never storing the gathered
    tokens, https://arxiv.org/abs/2403.08245). Weight gradients are computed where autograd asks for them (a frozen
    base gets none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_t: torch.Tensor, a_t: torch.Tensor, offs: torch.Tensor,
                source: torch.Tensor | None, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.gathered = source is not None
        ctx.save_for_backward(source if ctx.gathered else x, rows, w_t, a_t, offs)
        return grouped_mm(x, w_t, offs), grouped_mm(x, a_t, offs)

    @staticmethod
    def backward(ctx, grad_base: torch.Tensor, grad_u: torch.Tensor):
        kept, rows, w_t, a_t, offs = ctx.saved_tensors
        grad_base, grad_u = grad_base.contiguous(), grad_u.contiguous()
        grad_w = grad_a = grad_x = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            x = (kept[rows] if ctx.gathered else kept).detach()
            with torch.enable_grad():
                leaves = [w.detach().requires_grad_() for w in (w_t, a_t)]
                pairs = [(grouped_mm(x, leaf, offs), leaf, g) for leaf, g, need in
                         zip(leaves, (grad_base, grad_u), ctx.needs_input_grad[1:3]) if need]
                grads = iter(torch.autograd.grad([p[0] for p in pairs], [p[1] for p in pairs], [p[2] for p in pairs]))
            del x
            grad_w = next(grads) if ctx.needs_input_grad[1] else None
            grad_a = next(grads) if ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_mm(grad_base, w_t.transpose(-2, -1), offs)
            grad_x.add_(grouped_mm(grad_u, a_t.transpose(-2, -1), offs))
        return grad_x, grad_w, grad_a, None, None, None


class _WeightedGate(torch.autograd.Function):
    """``gate(h) * w[:, None]`` (the experts' gate or activation, then each pair's routing weight), keeping only
    ``h`` and ``w`` for backward and recomputing the gate there: the gate's intermediates (``[S, I]`` each) are not
    stored."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, gate) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        ctx.gate = gate
        return (gate(h) * w.unsqueeze(-1)).to(h.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, w = ctx.saved_tensors
        with torch.enable_grad():
            h_ = h.detach().requires_grad_(ctx.needs_input_grad[0])
            w_ = w.detach().requires_grad_(ctx.needs_input_grad[1])
            out = (ctx.gate(h_) * w_.unsqueeze(-1)).to(h.dtype)
            wanted = [t for t in (h_, w_) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (next(grads) if h_.requires_grad else None), (next(grads) if w_.requires_grad else None), None


class _CombinePairs(torch.autograd.Function):
    """``[S, H]`` pair outputs sorted by expert -> ``[n, H]``: each token's ``k`` outputs summed, in slot order
    (transformers' deterministic gather + ``view(n, k, H).sum(1)``, not an ``index_add_``, whose CUDA kernel adds in
    any order). Backward is one gather of the token gradients, ``grad[rows]``, instead of autograd's zero-filled
    scatter of a copy of the expanded gradient."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, inverse: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(rows)
        return out.index_select(0, inverse).view(-1, k, out.shape[-1]).sum(dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        return grad[rows], None, None, None


def grouped_lora(x: torch.Tensor, weight_t: torch.Tensor, factors: ExpertFactors, offs: torch.Tensor,
                 routed: torch.Tensor, gathered_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One grouped projection with its adapter: ``x W_e^T + scaling * (x A_e^T) B_e^T`` for each row's expert ``e``.

    Args:
        x: ``[S, in]``, the token-expert pairs sorted by expert, in the weight's dtype.
        weight_t: the fused base weight as ``[E, in, out]`` (a transposed view of an ``[E, out, in]`` stack).
        factors: the weight's :class:`ExpertFactors`; computed in ``x``'s dtype (peft casts its factors to the
            weight's dtype, ``ParamWrapper.get_delta_factors``).
        offs: ``[E]`` int32 cumulative row counts.
        routed: ``[E]`` bool, the experts with at least one row (the others' gradients are exactly zero).
        gathered_from: ``(source [n, in], rows [S])`` when ``x = source[rows]``: backward gathers ``x`` again
            rather than keeping it.

    Returns:
        ``[S, out]`` in ``x``'s dtype.
    """
    a = _ZeroIdle.apply(factors.a, routed).to(x.dtype)                                  # [E, r, in]
    b = _ZeroIdle.apply(factors.b, routed).to(x.dtype).transpose(-2, -1).contiguous()  # [E, r, out]
    base, u = _BaseAndDown.apply(x, weight_t, a.transpose(-2, -1), offs, *(gathered_from or (None, None)))
    # the base product is kept by no one: the adapter's (scaled at [S, r], the smallest tensor) is added in place
    return base.add_(grouped_mm(u * factors.scaling, b, offs))


def _project(x: torch.Tensor, weight: torch.Tensor, transposed: bool, offs: torch.Tensor,
             factors: ExpertFactors | None, routed: torch.Tensor,
             gathered_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One grouped projection of the sorted pairs ``x [S, in]`` (already in the weight's dtype) by a fused weight
    stored ``[E, out, in]`` (or ``[E, in, out]`` when ``transposed``), plus its adapter if any."""
    weight_t = weight if transposed else weight.transpose(-2, -1)   # [E, in, out]
    if factors is None:
        return grouped_mm(x, weight_t, offs)
    return grouped_lora(x, weight_t, factors, offs, routed, gathered_from)


def split_experts_forward(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor, adapters: dict[str, ExpertFactors]) -> torch.Tensor:
    """The routed experts of one MoE layer with split LoRA on their fused weights.

    transformers' ``grouped_mm_experts_forward`` (``transformers/integrations/moe.py``), each projection plus
    :func:`grouped_lora`: the pairs sorted by expert, gate-up (or up) projection, the module's gate
    (``_apply_gate``) or activation, down projection, optional post-expert norm, routing weights, back to token
    order and summed over the ``k`` slots. Three differences keep backward's memory to the routed pairs' smallest
    tensors (same maths, other rounding order): the routing weight multiplies the down projection's input, not its
    output (``(w h) W = w (h W)``; a bias is weighted apart; not with a post-expert norm), the gate is recomputed in
    backward (:class:`_WeightedGate`), and the gathered tokens are gathered again in backward rather than kept
    (:class:`_BaseAndDown`). Saved for backward: the gate-up output ``[S, 2I]``, the weighted gate output
    ``[S, I]`` and two ``[S, r]`` per adapted weight (``S = n k``); each projection's backward holds one ``[S, in]``
    gradient for its input (:class:`_BaseAndDown`).

    Args:
        experts: a transformers experts module (:func:`layout_problem` is None for it).
        hidden_states: ``[n, H]``, the layer's tokens.
        top_k_index: ``[n, k]`` expert of each slot.
        top_k_weights: ``[n, k]`` routing weight of each slot.
        adapters: the fused weights' :class:`ExpertFactors` by parameter name (``gate_up_proj``, ``up_proj``,
            ``down_proj``); a weight without one computes its base only.

    Returns:
        ``[n, H]`` in ``hidden_states``' dtype.
    """
    k = top_k_index.shape[-1]
    num = experts.num_experts
    ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)          # [S] expert ids, grouped
    rows = perm // k                                                       # [S] the token of each pair
    weights = top_k_weights.reshape(-1)[perm]                              # [S]
    # histc (float on CPU, int on CUDA) as transformers does: no bincount, deterministic on both
    counts = torch.histc(ids.float() if ids.device.type in ("cpu", "mps") else ids.int(), bins=num, min=0,
                         max=num - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)                  # [E]
    routed = counts > 0                                                    # [E]
    first = "gate_up_proj" if experts.has_gate else "up_proj"
    up = getattr(experts, first)
    source = hidden_states.to(up.dtype)
    x = source[rows]                                                       # [S, H]
    h = _project(x, up, experts.is_transposed, offs, adapters.get(first), routed, (source, rows))
    del x
    if experts.has_bias:
        h.add_(getattr(experts, f"{first}_bias")[ids])
    gate = experts._apply_gate if experts.has_gate else experts.act_fn
    norm = getattr(experts, "has_post_expert_norm", False)
    down = experts.down_proj
    if norm:
        h = gate(h).to(down.dtype)
    else:
        h = _WeightedGate.apply(h, weights, gate).to(down.dtype)           # [S, I], weighted
    out = _project(h, down, experts.is_transposed, offs, adapters.get("down_proj"), routed)   # [S, H]
    del h
    if experts.has_bias:
        bias = experts.down_proj_bias[ids]
        out = out + (bias if norm else bias * weights.unsqueeze(-1).to(bias.dtype))
    if norm:
        out = experts.post_expert_norm(out) * weights.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)       # sorted position of pair t*k + j
    return _CombinePairs.apply(out, inverse, rows, k).to(hidden_states.dtype)


# What transformers' use_experts_implementation sets on an experts module (transformers 5), which
# split_experts_forward reads.
CONTRACT = ("has_gate", "has_bias", "is_transposed", "num_experts", "down_proj")


def layout_problem(experts: torch.nn.Module, adapted: list[str]) -> str | None:
    """Why :func:`split_experts_forward` cannot compute ``experts`` with LoRA on ``adapted`` (parameter names), or
    None when it can: the module must carry transformers' ``use_experts_implementation`` contract (the flags
    ``has_gate``, ``has_bias``, ``is_transposed``; ``num_experts``; ``gate_up_proj`` or ``up_proj`` and
    ``down_proj`` as ``[E, ., .]``), not be expert-parallel, and LoRA must adapt only those weights."""
    missing = [a for a in CONTRACT if not hasattr(experts, a)]
    if missing:
        return f"{type(experts).__name__} lacks {', '.join(missing)} (not a transformers 5 experts module)"
    first = "gate_up_proj" if experts.has_gate else "up_proj"
    if not hasattr(experts, first):
        return f"{type(experts).__name__} has no {first}"
    if getattr(experts, "_is_expert_parallel", False):
        return f"{type(experts).__name__} is expert-parallel"
    if experts.has_gate and not callable(getattr(experts, "_apply_gate", None)):
        return f"{type(experts).__name__} has no _apply_gate"
    if not experts.has_gate and not callable(getattr(experts, "act_fn", None)):
        return f"{type(experts).__name__} has no act_fn"
    num = experts.num_experts
    for name in (first, "down_proj"):
        shape = tuple(getattr(getattr(experts, name), "ds_shape", getattr(experts, name).shape))
        if len(shape) != 3 or shape[0] != num:
            return f"{type(experts).__name__}.{name} is {list(shape)}, not [{num}, ., .]"
    others = sorted(set(adapted) - {first, "down_proj"})
    if others:
        return f"LoRA on {', '.join(others)} of {type(experts).__name__}"
    return None
