"""Tolerances from the arithmetic, shared by the tests (the rule is also in tests/README.md).

A test compares numbers in one of two ways, never with a bound read off one machine's run:

(a) **exact**: two paths that do the same floating-point operations in the same order (a resumed run and an
    uninterrupted one, a cast of a cast, chunking that the code keeps row-identical): ``==`` / ``torch.equal``;
(b) **derived**: against a float64 reference of the same inputs, within the rounding error that float32 (or bf16)
    arithmetic can make on the reductions involved. For a sum of ``n`` terms computed in a format of unit
    round-off ``eps`` the error is at most ``(n - 1) eps sum|terms|`` (Higham, *Accuracy and Stability of Numerical
    Algorithms*, 2nd ed., eq. 4.4); rounding errors of random sign grow like ``sqrt(n)`` instead of ``n`` (Higham
    sec. 4.2, and pairwise/blocked sums as in BLAS and ATen grow like ``log2 n``), so the bound used here is
    ``C * eps * sqrt(n) * sum|terms|`` with the safety constant :data:`C`. Two float32 paths are each within the
    bound of the float64 reference, so within twice the bound of each other (triangle inequality).

A bound so derived holds on any CPU (AVX2, AVX-512, AMX, another summation order or thread count) and on a GPU,
because it depends on the reduction's length and the terms' magnitudes only. A test that loosens a bound to this
form must still fail on the bug it guards (a dropped row, a wrongly scaled chunk, a tail read from padding): those
change a result by a fraction of a token's share, orders above ``eps * sqrt(n)``.
"""

from __future__ import annotations

import math

import torch

EPS32 = torch.finfo(torch.float32).eps    # 2**-23 = 1.19e-7 (the spacing at 1; unit round-off is half of it)
EPS_BF16 = torch.finfo(torch.bfloat16).eps  # 2**-7 = 7.8e-3
C = 4.0  # safety constant over sqrt(n) growth: covers a few chained reductions of the same length


def sum_bound(n: int, abs_sum: float, eps: float = EPS32, c: float = C) -> float:
    """Bound on the rounding error of a sum of ``n`` terms whose absolute values sum to ``abs_sum``:
    ``c * eps * sqrt(n) * abs_sum`` (same units as the terms)."""
    return c * eps * math.sqrt(max(n, 1)) * abs_sum


def rel_bound(n: int, eps: float = EPS32, c: float = C) -> float:
    """Relative bound ``c * eps * sqrt(n)`` of a length-``n`` reduction whose terms' absolute sum is of the order of
    its result (no heavy cancellation, e.g. a sum of positive terms, or a gradient normalised by its largest
    element): the relative form of :func:`sum_bound`."""
    return c * eps * math.sqrt(max(n, 1))


def dot_rel(n: int, eps: float = EPS32, c: float = C) -> float:
    """Relative bound ``c * eps * n`` of a dot product of ``n`` terms of random sign, relative to the size of its
    result: such terms cancel, ``sum|terms| ~ sqrt(n) |result|``, so :func:`sum_bound`'s
    ``c eps sqrt(n) sum|terms|`` is ``c eps n |result|`` (a hidden-width matmul of a random-init model)."""
    return c * eps * max(n, 1)


def fp32_paths_rel(n_longest: int, n_dot: int, eps: float = EPS32, c: float = C) -> float:
    """How far two float32 computations of the same model quantity (loss, logits, a gradient tensor) that sum in
    different orders (padded vs packed rows, batched vs one row, chunked vs not, another kernel) may be apart,
    relative to the quantity's largest element: each is within ``c eps sqrt(n_longest)`` (the longest reduction,
    e.g. over the vocabulary) plus ``c eps n_dot`` (the cancelling dot products of width ``n_dot``, the hidden
    size) of the float64 value, so within twice that of each other."""
    return 2 * (rel_bound(n_longest, eps, c) + dot_rel(n_dot, eps, c))


def ce_sum_bounds(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, w: torch.Tensor,
                  eps: float = EPS32, c: float = C) -> tuple[float, torch.Tensor]:
    """Rounding bounds of ``L = sum_m w_m CE(hidden_m @ weight.T, t_m)`` and of ``dL/dhidden`` computed in a format
    of precision ``eps``, from the float64 values of the same inputs.

    Derivation, per position ``m`` (``z = h W^T`` over ``H`` terms, ``V`` logits):
      - each logit: ``|dz_v| <= c eps sqrt(H) sum_i |h_i W_vi|``; let ``dz = max_v |dz_v|``;
      - ``lse = max + log sum_v exp(z_v - max)``: a sum of ``V`` positive terms (``sum|terms| = sum``), so its
        relative error is ``c eps sqrt(V)``, an absolute error of the log; plus ``dz`` and ``eps |lse|``;
      - ``CE = lse - z_t``: ``<= 2 dz + c eps sqrt(V) + eps |lse|``;
      - ``L = sum_m w_m CE_m``: ``sum_m w_m |dCE_m| + c eps sqrt(M) sum_m |w_m CE_m|``.
      - ``dL/dh_m = w_m (p_m - y_m) W`` over ``V`` terms: ``c eps sqrt(V) w_m sum_v |p_v - y_v| |W_vj|`` plus the
        error of ``p = exp(z - lse)``, relative ``<= 2 dz + c eps sqrt(V) + eps |lse|`` in each term.

    Args:
        hidden: ``[M, H]`` hidden states (any float dtype; used in float64).
        weight: ``[V, H]`` LM-head weight.
        targets: ``[M]`` target ids.
        w: ``[M]`` per-position weights (0 outside the tail).

    Returns:
        (bound on ``|L - L64|`` in nats x weight, ``[M, H]`` elementwise bound on ``|dL/dh - dL/dh64|``).
    """
    h, W, w = hidden.detach().double(), weight.detach().double(), w.detach().double()
    M, H = h.shape
    V = W.shape[0]
    z = h @ W.T                                                        # [M, V]
    lse = torch.logsumexp(z, -1)                                       # [M]
    ce = lse - z.gather(-1, targets[:, None]).squeeze(-1)              # [M]
    dz = c * eps * math.sqrt(H) * (h.abs() @ W.abs().T).amax(-1)       # [M]
    dce = 2 * dz + c * eps * math.sqrt(V) + eps * lse.abs()            # [M]
    loss = (w * dce).sum() + c * eps * math.sqrt(M) * (w * ce).abs().sum()
    p_minus_y = torch.softmax(z, -1)
    p_minus_y[torch.arange(M), targets] -= 1
    terms = p_minus_y.abs() @ W.abs()                                  # [M, H]: sum_v |p_v - y_v| |W_vj|
    grad = w[:, None] * (c * eps * math.sqrt(V) + dce[:, None]) * terms
    return loss.item(), grad


# The tiny-llama jobs (configs/train/tiny_cpu.yaml: SmolLM2's tokenizer, V = 49,152; MLP width 128): two fp32
# computations of one evaluation or one step's loss and gradients, relative: 2 (4 eps sqrt(49152) + 4 eps 128) = 3.3e-4.
TINY_JOB_REL = fp32_paths_rel(49152, 128)


# Full fine-tune of the tiny job in two launch modes (benchmarks/parity.py's `full` rows, tests/test_full_launch.py,
# docs/full.md). Every mode runs the same per-row forward and differs only in how sums are grouped (micro-batches,
# ranks, accumulation, the flat buffers DeepSpeed reduces and takes the norm of); an fp32 sum of n terms regrouped
# moves by at most C u sqrt(n) sum|terms| (u = 2^-24, the unit round-off).
UNIT_ROUNDOFF = 2.0 ** -24
# Step 1 (the same weights in both modes): the loss, a sum of positive terms over a window of at most 8 rows x 64
# positions = 512, is within C u sqrt(512) of the float64 value, relative; two modes within twice that: 1.08e-5.
FULL_STEP_REL = 2 * C * UNIT_ROUNDOFF * math.sqrt(512)


def full_norm_rel(n_params: int) -> float:
    """Two modes' global gradient norms of the same gradient, relative: the squared norm is a sum of ``n_params``
    positive terms (each mode within ``C u sqrt(n)`` of the float64 value, relative), the square root halves that,
    two modes within twice: ``C u sqrt(n_params)`` (4.3e-4 for the tiny Llama's 3.23M weights)."""
    return C * UNIT_ROUNDOFF * math.sqrt(n_params)


def full_drift(lrs: list[float], grad_norms: list[float], max_grad_norm: float, n_params: int) -> list[float]:
    """First-order bounds on ``||W_a - W_b||_2`` (all weights) of two modes after each SGD step with the global norm
    clipped to ``max_grad_norm``: step t moves the weights by ``lr_t min(||g_t||, max_grad_norm)`` in L2, with the
    norm (hence the clip factor) within :func:`full_norm_rel` and the gradient's direction within as much (its
    elements are sums over <= 512 positions, ``C u sqrt(512)`` far below it), so the two modes' steps differ by at most
    ``2 full_norm_rel lr_t min(||g_t||, c)``, summed over the steps. First order: an early difference's growth through
    later gradients (``(1 + lr_t L)`` per step for the loss's curvature L) is not in it."""
    rel, out, drift = full_norm_rel(n_params), [], 0.0
    for lr, g in zip(lrs, grad_norms):
        drift += 2 * rel * lr * min(g, max_grad_norm)
        out.append(drift)
    return out


def full_loss_bounds(losses: list[float], lrs: list[float], grad_norms: list[float], max_grad_norm: float,
                     n_params: int) -> list[float]:
    """First-order bounds on two modes' loss at each step, relative to it: the step's own regrouping
    (:data:`FULL_STEP_REL`) plus ``||g_t||_2 ||W_a - W_b||_2`` with the weights' difference before the step
    (:func:`full_drift`), divided by the loss."""
    drift = [0.0, *full_drift(lrs, grad_norms, max_grad_norm, n_params)[:-1]]
    return [FULL_STEP_REL + g * d / loss for loss, g, d in zip(losses, grad_norms, drift)]


def l2_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||a - b||_2`` over every tensor of two state dicts with the same names (inf when the names differ)."""
    if a.keys() != b.keys():
        return math.inf
    return math.sqrt(sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a))
