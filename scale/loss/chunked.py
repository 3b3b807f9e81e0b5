"""Chunked tail cross-entropy: the loss of ``M = B x N`` tail positions without ever holding fp32 ``[B, N, V]``.

An SFT tail is the whole answer, so ``[B, N, V]`` fp32 logits (and the two or three tensors of that size its
backward keeps: log-softmax, its gradient) are the peak of a step. Here the model is run for the *hidden states*
the LM head would see (:func:`forward_tail_hidden`: ``[B, N, H]``, ``H`` the hidden size), and the tail is cut
into chunks of ``C`` positions; each chunk goes through the LM head, fp32 logits ``[C, V]`` and the weighted CE,
and is freed before the next (:func:`chunked_tail_loss`). The same approach as torchtune's
``LinearCrossEntropyLoss`` / TRL's chunked NLL (chunks + recomputation) and Liger's fused linear cross-entropy
(the gradient of each chunk computed in the forward pass, https://github.com/linkedin/Liger-Kernel).

Two paths, both exact against :func:`scale.loss.tail.tail_loss` of the full logits up to float round-off: in float64
they agree to 1e-12; in float32 the loss agrees within 1e-6 relative and the LoRA gradients within 2e-6 of each
tensor's largest element, the size of either path's own round-off against a float64 reference (0.9-1.5e-6 on
tiny models at V = 49,152), and the chunked gradients are never further from float64 than the unchunked ones
(x1.25, ``tests/test_chunked.py``). Chunks hold at least two rows (:func:`chunk_bounds`): a one-row LM-head
product runs as a matrix-vector product with several times the round-off.

- **fused** (plain ``nn.Linear`` head whose weights are frozen, cross-entropy, no ZeRO-3 partitioned weight):
  each chunk's gradient w.r.t. its hidden states, ``w * (softmax - onehot) @ W`` ``[C, H]``, is computed in the
  forward pass and kept (``[M, H]``, ``H`` << ``V``); backward only scales it. Two LM-head products per chunk,
  as without chunks.
- **checkpointed** (a user ``loss.criterion``, a head with LoRA or a trainable weight, ZeRO-3): each chunk is a
  non-reentrant ``torch.utils.checkpoint`` of head -> fp32 logits -> :func:`scale.loss.tail.tail_loss`, so backward
  holds one chunk at a time (one more LM-head product per chunk). A criterion must then be per-token (it
  returns ``[M]`` losses or their mean, as ``loss.criterion`` documents): its sum over chunks is its sum.

:meth:`scale.objectives.tail.LossSpec.loss_step` (one micro-batch's loss, the training loop's) picks this path when it
pays, else the unchunked one.

Plain tensors only: no accelerate, no torch.distributed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from scale.loss import tail as scale_loss

CHUNK_BYTES = 64 * 2**20
"""``loss.chunk_size: auto`` keeps one chunk's fp32 logits ``[C, V]`` at or below this many bytes (64 MiB)."""
CHUNK_FROM_BYTES = 256 * 2**20
"""``loss.chunk_size: auto`` chunks a micro-batch whose whole fp32 tail logits ``[B x N, V]`` would exceed this
(256 MiB); below it the unchunked loss is kept (classification's few positions, short answers)."""

# Config attributes of families whose forward transforms the LM head's output (softcapping, scaling): the chunked
# path would skip that step, so those families keep the unchunked loss.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The LM head (``get_output_embeddings()``) of a causal LM, unwrapping DDP/DeepSpeed (``.module``) and PEFT."""
    m = model
    while not hasattr(m, "get_output_embeddings") and hasattr(m, "module"):
        m = m.module
    head = m.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(m).__name__} has no output embeddings (LM head): the chunked loss needs one")
    return head


def _base_config(model: torch.nn.Module) -> Any:
    m = model
    while not hasattr(m, "config") and hasattr(m, "module"):
        m = m.module
    return getattr(m, "config", None)


def vocab_size(model: torch.nn.Module) -> int:
    """``V``, the LM head's output width (``out_features``; the config's ``vocab_size`` under ZeRO-3)."""
    head = output_head(model)
    v = getattr(head, "out_features", None)
    return int(v) if v else int(_base_config(model).vocab_size)


def chunkable(model: torch.nn.Module) -> bool:
    """Whether the model's logits are exactly ``lm_head(hidden)``: no softcapping/scaling after the head."""
    cfg = _base_config(model)
    text = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    return not any(getattr(c, a, None) not in (None, 1, 1.0) for c in (cfg, text) if c is not None
                   for a in _LOGIT_TRANSFORMS)


def resolve_chunk_size(setting: int | str, positions: int, vocab: int) -> int:
    """Positions per chunk for ``loss.chunk_size``, or 0 for the unchunked loss.

    Args:
        setting: ``"auto"`` (or ``"liger"``, decided as ``auto``), ``0`` (off) or a positive number of positions.
        positions: ``M = B x N`` tail positions of the micro-batch.
        vocab: ``V``.

    Returns:
        ``C >= 1`` when the tail is cut into more than one chunk, else 0. ``auto``: unchunked while the whole
        tail's fp32 logits stay within :data:`CHUNK_FROM_BYTES`, else the largest multiple of 8 positions whose
        fp32 logits fit :data:`CHUNK_BYTES` (at least 8).
    """
    if setting in ("auto", "liger"):  # liger (loss.fused): Liger chunks itself, where auto would chunk
        if positions * vocab * 4 <= CHUNK_FROM_BYTES:
            return 0
        size = max(8, CHUNK_BYTES // (4 * vocab) // 8 * 8)
    else:
        size = int(setting)
    return size if 0 < size < positions else 0


@contextlib.contextmanager
def head_returns_hidden(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block the LM head returns its input (the final hidden states ``[..., H]``) instead of logits.

    A forward pre-hook hands the head a zero-length slice (no ``[.., V]`` product is computed) and a forward
    hook returns the hidden states it was given, so the model's own ``logits_to_keep`` selection and every
    caller of the model (DDP, DeepSpeed, PEFT) run unchanged.
    """
    head = output_head(model)
    seen: list[Tensor] = []

    def pre(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        seen.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    def post(_module: torch.nn.Module, _args: tuple[Any, ...], _out: Any) -> Tensor:
        return seen.pop()

    handles = [head.register_forward_pre_hook(pre), head.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def forward_tail_hidden(model: torch.nn.Module, batch: dict[str, Tensor], padding_side: str = "left",
                        check: bool = True) -> tuple[Tensor, Tensor]:
    """:func:`scale.loss.tail.forward_tail`, returning the hidden states the LM head would see instead of logits.

    Returns:
        ``(tail_hidden [B, N, H], targets [B, N])``, padded or padding-free batches alike.

    Raises:
        ValueError: as :func:`scale.loss.tail.forward_tail`.
    """
    with head_returns_hidden(model):
        return scale_loss.forward_tail(model, batch, padding_side=padding_side, check=check)


def chunk_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the chunks of ``n`` positions: ``chunk`` each (at least 2), the last one taking a
    lone remaining row (``chunk + 1``).

    A one-row LM-head product ``[1, H] x [H, V]`` runs as a matrix-vector product (MKL's GEMV on CPU), whose
    float32 round-off measured 7x a matrix product's over V = 49,152 (2.7e-6 against 4.1e-7 of the largest
    element): one-row chunks made the chunked LoRA gradients 3.6e-6 off a float64 reference where the unchunked
    were 0.9e-6 off. With at least two rows the product is the same GEMM as the unchunked loss's.
    """
    size = max(chunk, 2)
    starts = list(range(0, n, size))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    return [(s, starts[j + 1] if j + 1 < len(starts) else n) for j, s in enumerate(starts)]


def _two_rows(h: Tensor, t: Tensor, w: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
    """A one-row chunk (a micro-batch with one trained position) padded with a copy of weight 0, so that its
    LM-head products are matrix products (see :func:`chunk_bounds`); other chunks unchanged."""
    if h.shape[0] != 1:
        return (h, t, w, *rest)
    pad = [torch.cat([x, x]) for x in (h, t)] + [torch.cat([w, torch.zeros_like(w)])]
    return (*pad, *(torch.cat([r, r]) for r in rest))


class _FusedLinearCE(torch.autograd.Function):
    """``sum_m w_m * CE(h_m @ W^T + b, t_m)`` chunk by chunk; the gradient w.r.t. ``h`` is computed in forward."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, w: Tensor,
                chunk: int) -> Tensor:
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if need_grad else None
        total = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        for s, e in chunk_bounds(hidden.shape[0], chunk):
            h, t, wc = _two_rows(hidden[s:e], targets[s:e], w[s:e])      # a lone row padded with a weight-0 row
            lin = F.linear(h, weight, bias)                                # [C, V] (autocast dtype if any)
            logits = lin if lin.dtype == torch.float64 else lin.float()   # fp64 kept (exactness checks)
            lse = torch.logsumexp(logits, dim=-1)                          # [C]
            token = lse - logits.gather(1, t[:, None])[:, 0]               # [C] CE in nats
            keep = wc != 0  # outside the tail: masked, never 0 * a possible inf/NaN
            total = total + (token.masked_fill(~keep, 0.0) * wc).sum()
            if need_grad:
                g = logits.sub_(lse[:, None]).exp_()                       # softmax, in place of the logits
                g[torch.arange(len(t), device=t.device), t] -= 1.0
                g.mul_(wc[:, None]).masked_fill_(~keep[:, None], 0.0)     # in place: one [C, V] at a time
                grad[s:e] = (g.to(lin.dtype) @ weight.to(lin.dtype))[:e - s]
                del g
            del lin, logits
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.to(grad.dtype) if grad is not None else None), None, None, None, None, None


def liger_tail_loss(hidden: Tensor, head: torch.nn.Linear, targets: Tensor, w: Tensor) -> Tensor:
    """``sum_m w_m * CE(head(h_m), t_m)`` through Liger-Kernel's fused linear cross-entropy (``loss.fused: liger``).

    Liger (https://github.com/linkedin/Liger-Kernel, ``liger_kernel.transformers.functional``) computes the LM head
    and the cross-entropy chunk by chunk in Triton kernels, the gradient in the forward pass, as the fused path here
    does. Its kernels are Triton only (liger-kernel 0.8.5 imports ``triton`` in ``ops/fused_linear_cross_entropy.py``
    and ships no PyTorch fallback), so it runs on CUDA and was not run on this project's CPU machines: no CPU test
    compares it with the chunked loss (tests/test_gpu.py does, on a GPU).

    Args:
        hidden: ``[M, H]`` hidden states of the kept tail positions.
        head: the frozen LM head.
        targets: ``[M]`` token ids.
        w: ``[M]`` weights, each 1 or 0 (``loss.type_weights`` and ``loss.criterion`` are refused with it): a
            position of weight 0 is ignored (target ``-100``).

    Returns:
        The float32 numerator ``[]``.
    """
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(hidden, head.weight, targets.masked_fill(w == 0, -100), bias=head.bias,
                                           reduction="sum")
    return (out[0] if isinstance(out, tuple) else out).float()


def _fusable(head: torch.nn.Module) -> bool:
    params = [head.weight] + ([head.bias] if head.bias is not None else [])
    return type(head) is torch.nn.Linear and not any(p.requires_grad or hasattr(p, "ds_id") for p in params)


def chunked_tail_loss(model: torch.nn.Module, tail_hidden: Tensor, targets: Tensor, weights: Tensor, chunk: int,
                      type_indicator: Tensor | None = None, criterion: scale_loss.Criterion | None = None,
                      criterion_mode: str = "plain", drop_zero_weights: bool = True, fused: str | None = None
                      ) -> tuple[Tensor, Tensor]:
    """:func:`scale.loss.tail.tail_loss` of ``lm_head(tail_hidden)``, ``chunk`` positions at a time.

    Args:
        model: the causal LM whose head (:func:`output_head`) makes the logits.
        tail_hidden: ``[B, N, H]`` from :func:`forward_tail_hidden`.
        targets: ``[B, N]`` token ids.
        weights: ``[B, N]`` token weights (0 outside each row's tail), as for :func:`scale.loss.tail.tail_loss`.
        chunk: positions per chunk ``C >= 1``; peak extra memory is about ``C x V`` fp32 (x3 in backward of the
            checkpointed path) instead of ``B x N x V``.
        type_indicator: ``[B]``, for ``criterion_mode="input"``.
        criterion: a per-token user criterion (see :func:`scale.loss.tail.tail_loss`).
        criterion_mode: ``"plain"`` or ``"input"``.
        drop_zero_weights: positions of weight 0 skip the head (one host sync); False keeps every position (the
            planner's count on fake tensors, whose ``nonzero`` has no size).
        fused: ``"liger"`` (``loss.fused``): the fusable cross-entropy goes through :func:`liger_tail_loss`.

    Returns:
        ``(numerator, denominator)``, float32 scalars ``[]``, equal to the unchunked loss's up to round-off.
    """
    B, N, H = tail_hidden.shape
    head = output_head(model)
    flat_h, flat_t = tail_hidden.reshape(B * N, H), targets.reshape(B * N)
    w = weights.reshape(B * N).float()
    types = (type_indicator[:, None].expand(B, N).reshape(B * N) if type_indicator is not None
             else torch.zeros(B * N, dtype=torch.long, device=flat_t.device))
    # Only positions of non-zero weight go through the head: the columns left of a short row's tail (the tail is
    # as wide as the longest row's; packed rows repeat a position there) and untrained chat turns add nothing.
    # One host sync per micro-batch (nonzero), small next to a loss big enough to be chunked. A micro-batch of
    # weight 0 only (a stand-in at an epoch's end) keeps every position, so that backward still reaches the head.
    keep = (w != 0).nonzero().squeeze(1) if drop_zero_weights else w[:0]
    if keep.numel():
        flat_h, flat_t, w, types = flat_h[keep], flat_t[keep], w[keep], types[keep]
    if criterion is None and _fusable(head) and fused == "liger":
        return liger_tail_loss(flat_h, head, flat_t, w), w.sum()
    if criterion is None and _fusable(head):
        num = _FusedLinearCE.apply(flat_h, head.weight, head.bias, flat_t, w, chunk)
        return num, w.sum()

    def one(h: Tensor, t: Tensor, wc: Tensor, ty: Tensor) -> Tensor:
        # A chunk of C positions as C rows of one position: tail_loss (and a criterion) see per-token types.
        num, _ = scale_loss.tail_loss(head(h)[:, None, :], t[:, None], wc[:, None], ty, criterion, criterion_mode)
        return num

    num = torch.zeros((), dtype=torch.float32, device=flat_h.device)
    for s, e in chunk_bounds(w.shape[0], chunk):
        args = _two_rows(flat_h[s:e], flat_t[s:e], w[s:e], types[s:e])
        if criterion is not None and not bool((args[2] > 0).any()):  # host sync (a criterion syncs anyway)
            continue  # no tail token in this chunk: a criterion's mean of nothing would be NaN
        num = num + (checkpoint(one, *args, use_reentrant=False) if torch.is_grad_enabled() else one(*args))
    return num, (w > 0).sum().float() if criterion is not None else w.sum()
