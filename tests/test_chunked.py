"""Chunked tail loss (scale.loss.chunked) against today's unchunked loss: loss and LoRA gradients within fp32
round-off (tests/bounds.py) on the tiny vocabulary, for padded (left/right) and padding-free batches, type weights
and user criteria (plain and per-type), fused and checkpointed paths; at the real vocabulary both within fp32
round-off of a float64 reference; fp32 [B, N, V] is never built."""

from __future__ import annotations

import pytest
import torch

from scale.config.schema import LoraConfig, ModelConfig
from scale.data import Collator, Example
from scale.data.collate import PaddingFreeCollator
from scale.loss import chunked
from scale.loss import tail as scale_loss
from scale.modeling.build import build_model, load_base
from scale.objectives.tail import LossSpec
from tests.test_loss import my_criterion, my_typed_criterion

V = 300


def _model(targets="all-linear"):
    if targets == "all-linear":
        return build_model(ModelConfig(name_or_path="tiny-llama", gradient_checkpointing=False),
                           LoraConfig(r=4, dropout=0.0, target_modules=targets), vocab_size=V, seed=0)
    import peft  # scale refuses lm_head as a target name (tied head); peft itself takes it

    torch.manual_seed(0)
    base = load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=V, seed=0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    return model.train()


def _examples():
    g = torch.Generator().manual_seed(3)
    lengths, tails = (14, 9, 20, 6), (10, 3, 17, 5)   # SFT-like: tails of different lengths, most of the row
    return [Example(torch.randint(3, V, (n,), generator=g).tolist(), t, i % 3, 7, row=i)
            for i, (n, t) in enumerate(zip(lengths, tails))]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _run(model, batch, spec, chunk):
    """(loss, LoRA grads) of one micro-batch through LossSpec.loss_step with loss.chunk_size=chunk."""
    model.zero_grad(set_to_none=True)
    spec.chunk_size = chunk
    w = spec.weights(batch)
    num = spec.loss_step(model, batch, w)
    den = (w > 0).sum().float() if spec.criterion is not None else w.sum()
    (num / den).backward()
    return (num / den).item(), _grads(model)


def _spec(side="left", type_weights=None, criterion=None, mode="plain"):
    criterion = scale_loss.bind_criterion(criterion, mode) if criterion is not None else None  # as from_config
    return LossSpec(padding_side=side, type_weights=type_weights, criterion=criterion)


def _assert_same(a, b, tol=None):
    """Loss and every gradient tensor within ``tol`` relative (to the loss; to each tensor's largest element, at
    least 1e-3). Default: two fp32 paths summing in other orders, :func:`tests.bounds.fp32_paths_rel` over the
    vocabulary ``V`` and the MLP width 128 (1.4e-4)."""
    if tol is None:
        from tests.bounds import fp32_paths_rel

        tol = fp32_paths_rel(V, 128)
    (la, ga), (lb, gb) = a, b
    assert la == pytest.approx(lb, rel=tol, abs=0)
    for name in ga:
        scale = gb[name].abs().max().item()
        assert (ga[name] - gb[name]).abs().max().item() <= tol * max(scale, 1e-3), name


@pytest.mark.parametrize("side", ["left", "right", "packed"])
@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_equals_unchunked_loss_and_grads(side, chunk):
    model, ex = _model(), _examples()
    batch = PaddingFreeCollator()(ex) if side == "packed" else Collator(2, side)(ex)
    spec = _spec("left" if side == "packed" else side, type_weights=[1.0, 0.5, 2.0])
    ref, got = _run(model, batch, spec, 0), _run(model, batch, spec, chunk)
    assert any(g.abs().max() > 0 for g in ref[1].values())
    _assert_same(got, ref)


@pytest.mark.parametrize("criterion,mode", [(my_criterion, "plain"), (my_typed_criterion, "input")])
def test_chunked_user_criterion_is_exact(criterion, mode):
    model, ex = _model(), _examples()
    batch = Collator(2, "left")(ex)
    spec = _spec(criterion=criterion, mode=mode)
    _assert_same(_run(model, batch, spec, 5), _run(model, batch, spec, 0))


def test_checkpointed_path_with_lora_on_the_head_is_exact():
    """LoRA on lm_head: the head is no plain frozen Linear, so the checkpointed path runs; its grads count too."""
    model, ex = _model(["q_proj", "v_proj", "lm_head"]), _examples()
    assert not chunked._fusable(chunked.output_head(model))
    batch = Collator(2, "right")(ex)
    spec = _spec("right", type_weights=[1.0, 0.5, 2.0])
    ref, got = _run(model, batch, spec, 0), _run(model, batch, spec, 6)
    assert any("lm_head" in n and g.abs().max() > 0 for n, g in ref[1].items())
    _assert_same(got, ref)


def test_auto_chunk_size_and_when_it_stays_unchunked():
    # chunks from 256 MiB of fp32 tail logits on, of 64 MiB: 341 positions of V=49152 -> 336 (a multiple of 8); V=128256 -> 128.
    assert chunked.resolve_chunk_size("auto", 2048, 49152) == 336
    assert chunked.resolve_chunk_size("auto", 2048, 128256) == 128
    assert chunked.resolve_chunk_size("auto", 16, 49152) == 0      # classification's 2 x 8 positions
    assert chunked.resolve_chunk_size("auto", 1365, 49152) == 0    # 256 MiB of fp32 logits: still unchunked
    assert chunked.resolve_chunk_size("auto", 1366, 49152) == 336
    assert chunked.resolve_chunk_size(0, 4096, 49152) == 0
    assert chunked.resolve_chunk_size(64, 65, 49152) == 64 and chunked.resolve_chunk_size(64, 64, 49152) == 0


def test_the_chunked_loss_never_builds_full_fp32_logits():
    """The largest tensor the chunked forward+backward creates holds one chunk's logits, not [B, N, V]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Biggest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == V and t.shape[0] != 64:  # not W^T
                    Biggest.biggest = max(Biggest.biggest, t.numel())
            return out

    model, ex = _model(), _examples()
    batch = Collator(2, "left")(ex)
    spec = _spec()
    B, N = batch["tail_mask"].shape
    for chunk, expect in ((0, B * N * V), (4, 4 * V)):
        Biggest.biggest = 0
        with Biggest():
            _run(model, batch, spec, chunk)
        assert Biggest.biggest == expect, chunk


def test_config_field_rules():
    from scale.config.load import load_config
    from scale.config.validation import ConfigError

    assert load_config("tiny_cpu").loss.chunk_size == "auto"
    assert load_config("tiny_cpu", ["loss.chunk_size=256"]).loss.chunk_size == 256
    with pytest.raises(ConfigError, match="loss.chunk_size='big' must be 'auto', 0"):
        load_config("tiny_cpu", ["loss.chunk_size=big"])


@pytest.mark.parametrize("side", ["left", "packed"])
def test_chunked_equals_unchunked_to_float64_round_off(side):
    """The fp32 differences above are round-off only: in float64 the chunked loss (fused path) and the
    unchunked one agree to 1e-12 on the loss and every LoRA gradient (fp32 at the real size: 2.5e-6 of the
    largest hidden-state gradient element, docs/benchmarks.md)."""
    model, ex = _model().double(), _examples()
    batch = PaddingFreeCollator()(ex) if side == "packed" else Collator(2, side)(ex)
    spec = _spec("left", type_weights=[1.0, 0.5, 2.0])
    ref, got = _run(model, batch, spec, 0), _run(model, batch, spec, 7)
    assert all(g.dtype == torch.float64 for g in ref[1].values())
    _assert_same(got, ref, tol=1e-12)


def _max_rel(a, b):
    """Largest ``max|a - b| / max|b|`` over the gradient tensors (tensors of zero gradient skipped)."""
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max()).item()
               for k in b if b[k].abs().max() > 0)


@pytest.mark.parametrize("chunk", [1, 2, 7, 16])
def test_chunked_is_as_close_to_float64_as_the_unchunked_loss(chunk):
    """At the real vocabulary (V = 49,152) the chunked and the unchunked fp32 LoRA gradients and losses are each
    within fp32 round-off of a float64 reference of the same model and batch (tests/bounds.py), and so within twice
    that of each other.

    The bound, per gradient tensor relative to its largest element: the longest reduction on the way is the LM head's
    over the vocabulary (dL/dh = sum_v (p_v - y_v) W_v, V terms; the forward's logsumexp is another V-term sum of
    positive terms); every other is over H = 64 or T <= 40 terms, each below eps * sqrt(V). sum_v |p_v - y_v| |W_vj|
    is within a small factor of the largest |dL/dh_j| (p near uniform at random init: about 2x), so
    rel_bound(V) = C * eps32 * sqrt(V) = 1.05e-4 (C = 4) holds for either path on any CPU. The loss (a mean of M tail
    CEs, each ~ln V = 10.8): per token c eps (sqrt(V) + |lse|) from the logsumexp, plus the mean over M tokens,
    C * eps32 * (sqrt(V) + sqrt(M) * L). A chunk dropped, rescaled or read from padding moves both by a token's
    share (~1/64 of the loss), orders above it. One-row chunks (run as matrix-vector products, less accurate but
    inside this bound) are ruled out by chunk_bounds itself (test_chunk_bounds_never_leave_a_lone_row)."""
    import copy

    from tests.bounds import EPS32, C, rel_bound

    V_real = 49152
    model = build_model(ModelConfig(name_or_path="tiny-llama", gradient_checkpointing=False),
                        LoraConfig(r=4, dropout=0.0, target_modules="all-linear"), vocab_size=V_real, seed=0)
    with torch.no_grad():  # lora_B starts at 0, which would leave every lora_A gradient 0
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    g = torch.Generator().manual_seed(3)
    ex = [Example(torch.randint(3, V_real, (n,), generator=g).tolist(), t, 0, 7, row=i)
          for i, (n, t) in enumerate(zip((40, 25, 33), (30, 9, 25)))]
    batch = Collator(2, "left")(ex)
    spec = _spec()
    ref = _run(copy.deepcopy(model).double(), batch, spec, 0)
    unchunked, chunked_ = _run(model, batch, spec, 0), _run(model, batch, spec, chunk)
    grad_bound = rel_bound(V_real)
    M = int(batch["tail_mask"].sum())
    loss_bound = C * EPS32 * (V_real ** 0.5 + M ** 0.5 * abs(ref[0]))
    for name, got in (("unchunked", unchunked), ("chunked", chunked_)):
        assert 0 < _max_rel(got[1], ref[1]) <= grad_bound, (name, _max_rel(got[1], ref[1]), grad_bound)
        assert abs(got[0] - ref[0]) <= loss_bound, (name, got[0], ref[0], loss_bound)
    assert _max_rel(chunked_[1], unchunked[1]) <= 2 * grad_bound
    assert abs(chunked_[0] - unchunked[0]) <= 2 * loss_bound


def test_fused_head_loss_body_on_cpu():
    """tests/test_gpu.py's Liger test body on CPU (the fused path without Liger, at a small shape with an explicit
    chunk), and the premise of its GPU shape: ``loss.chunk_size=auto`` chunks it and ``liger`` decides the same."""
    from tests.test_gpu import LIGER_SHAPE, fused_head_loss_against_float64, liger_premise

    assert liger_premise(**LIGER_SHAPE) == 336
    fused_head_loss_against_float64("cpu", None, M=96, H=32, V=1000, chunk=16)


def test_chunk_bounds_never_leave_a_lone_row():
    assert chunked.chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunked.chunk_bounds(9, 4) == [(0, 4), (4, 9)]          # the lone last row joins the chunk before
    assert chunked.chunk_bounds(5, 1) == [(0, 2), (2, 5)]          # chunks of at least 2 rows
    assert chunked.chunk_bounds(1, 8) == [(0, 1)]                  # one position: padded by _two_rows
    h, t, w = chunked._two_rows(torch.ones(1, 3), torch.tensor([4]), torch.tensor([2.0]))
    assert h.shape == (2, 3) and t.tolist() == [4, 4] and w.tolist() == [2.0, 0.0]
