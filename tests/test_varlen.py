"""Packed rows attended one example at a time (scale/modeling/varlen.py): the same outputs and gradients as
transformers' block-diagonal mask, within float32 round-off; whatever cannot be split runs masked; a padding-free run on
CPU switches it on."""

from __future__ import annotations

import pytest
import torch

from scale.modeling.varlen import segment_attention, segmentable, use_segment_attention
from tests.bounds import fp32_paths_rel


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


class _Layer(torch.nn.Module):
    """What transformers' attention functions read off the layer: GQA groups, causality, no window."""

    def __init__(self, groups: int = 1, sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.sliding_window = groups, True, sliding_window


def _block_mask(lens):
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    return ((seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :]))[None, None]


@pytest.mark.parametrize("groups", [1, 3])
def test_per_example_calls_match_the_block_diagonal_mask(groups):
    """Output and q/k/v gradients of one causal call per example = sdpa over the packed row with transformers'
    block-diagonal causal mask, in float32 (the same dot products over keys of one example, summed in other
    blocks): within fp32_paths_rel(longest example, head size) of the largest element; and far from the row
    attended causally across examples, which the check would miss otherwise."""
    lens, H, D = (5, 1, 12, 7, 3), 6, 16
    L = sum(lens)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, L, D, generator=g, requires_grad=True)
    k, v = (torch.randn(1, H // groups, L, D, generator=g, requires_grad=True) for _ in range(2))
    layer, grad_out = _Layer(groups), torch.randn(1, L, H, D, generator=g)
    fn = segment_attention(_sdpa)
    results = []
    for kwargs, mask in (({"packed_seq_lens": lens}, _block_mask(lens)), ({}, _block_mask(lens))):
        out, _ = fn(layer, q, k, v, mask, dropout=0.0, scaling=D ** -0.5, **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        results.append((out, *grads))
    rel = fp32_paths_rel(max(lens), D)
    for a, b in zip(*results):
        assert a.shape == b.shape and (a - b).abs().max() <= rel * a.abs().max()
    crossed, _ = _sdpa(layer, q, k, v, None, dropout=0.0, scaling=D ** -0.5)
    assert (crossed - results[0][0]).abs().max() > 100 * rel * results[0][0].abs().max()


def test_what_cannot_be_split_runs_masked():
    """Several rows, a cache (keys longer than queries), a sliding window shorter than an example, soft-capping:
    the inner function gets the whole input and the mask; wrong lengths raise."""
    calls = []

    def inner(module, q, k, v, mask, **kwargs):
        calls.append((q.shape[2], mask is None))
        return q.transpose(1, 2), None

    fn = segment_attention(inner)
    q = torch.zeros(1, 2, 10, 4)
    mask = torch.ones(1, 1, 10, 10, dtype=torch.bool)
    fn(_Layer(), q, q, q, mask, packed_seq_lens=(4, 6))
    assert calls == [(4, True), (6, True)]
    calls.clear()
    fn(_Layer(sliding_window=5), q, q, q, mask, packed_seq_lens=(4, 6))   # 6 > window 5
    fn(_Layer(sliding_window=6), q, q, q, mask, packed_seq_lens=(4, 6))   # fits: split
    fn(_Layer(), q, q, q, mask, packed_seq_lens=(4, 6), softcap=30.0)
    fn(_Layer(), torch.zeros(2, 2, 10, 4), torch.zeros(2, 2, 10, 4), torch.zeros(2, 2, 10, 4), mask,
       packed_seq_lens=(4, 6))
    fn(_Layer(), q[:, :, :1], q, q, mask, packed_seq_lens=(4, 6))
    fn(_Layer(), q, q, q, mask)
    assert calls == [(10, False), (4, True), (6, True), (10, False), (10, False), (1, False), (10, False)]
    with pytest.raises(ValueError, match="sum to 9 tokens but the packed row holds 10"):
        segmentable(_Layer(), q, q, (4, 5), {})


def test_tiny_model_trains_packed_rows_as_padded_with_per_example_attention(tokenizer, monkeypatch):
    """The tiny model (checkpointed layers: the backward recomputes each layer from the same keyword arguments)
    with per-example attention: a padding-free batch's tail logits and LoRA gradients match the padded batch's within
    fp32_paths_rel, as tests/test_sampling.py checks for transformers' mask; sdpa ran once per example in every
    layer, in the forward and in the recomputation, and once per layer on the padded batch; switching back restores
    sdpa."""
    import transformers.integrations.sdpa_attention as sdpa_module

    from scale.loss.tail import forward_tail
    from scale.objectives.tail import LossSpec
    from tests.test_sampling import PACKED_LENS as lens
    from tests.test_sampling import padding_free_case

    model, padded, packed = padding_free_case(tokenizer, checkpointing=True, type_of=lambda i: 0)
    spec = LossSpec(padding_side="left", type_weights=None, criterion=None)
    assert use_segment_attention(model) and model.config._attn_implementation == "sdpa_segments"
    calls, sdpa = [], sdpa_module.sdpa_attention_forward
    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward",
                        lambda m, q, *a, **kw: calls.append((q.shape[0], q.shape[2])) or sdpa(m, q, *a, **kw))
    logits, grads, seen = [], [], []
    for batch in (padded, packed):
        model.zero_grad()
        calls.clear()
        logits.append(forward_tail(model, batch)[0].detach())
        num = spec.loss_step(model, batch, spec.weights(batch))
        num.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        seen.append(list(calls))
    layers = model.config.num_hidden_layers  # forward_tail, loss_step's forward, the checkpointed recomputation
    assert seen[0] == [(4, 15)] * (3 * layers) and seen[1] == [(1, n) for n in lens] * (3 * layers)
    mask = padded["tail_mask"].bool()
    rel = fp32_paths_rel(len(tokenizer), model.config.intermediate_size)
    assert (logits[0][mask] - logits[1][mask]).abs().max() <= rel * logits[0][mask].abs().max()
    worst = max(float((grads[0][n] - grads[1][n]).abs().max() / grads[0][n].abs().max()) for n in grads[0])
    assert worst <= rel, (worst, rel)
    assert use_segment_attention(model, on=False) and model.config._attn_implementation == "sdpa"


def test_padding_free_benchmark_counts_real_tokens_over_the_timed_steps():
    """benchmarks/padding_free.py's figures: real tokens (tokens/s x the step's seconds) over the seconds and CPU
    seconds of the steps after the first, and the padding of the positions computed (tokens / (1 - pad))."""
    from benchmarks.padding_free import figures, longtail_rows

    rows = [{"train/tokens_per_s": 100.0, "train/data_s": 0.5, "train/compute_s": 1.5, "train/pad_fraction": 0.5,
             "train/loss": 2.0},                                                         # step 1: 200 tokens, not timed
            {"train/tokens_per_s": 300.0, "train/data_s": 0.0, "train/compute_s": 1.0, "train/pad_fraction": 0.25,
             "train/loss": 1.5},                                                         # 300 tokens of 400 positions
            {"train/tokens_per_s": 50.0, "train/data_s": 1.0, "train/compute_s": 1.0, "train/pad_fraction": 0.5,
             "train/loss": 1.0}]                                                         # 100 tokens of 200 positions
    got = figures({"rows": rows, "stamps": [10.0, 10.5, 12.5]})                          # CPU: 0.5 s and 2 s
    assert got["tps"] == 400 / 3 and got["tpc"] == 400 / 2.5 and got["pad"] == 1 - 400 / 600
    assert got["first_s"] == 2.0 and got["losses"] == [2.0, 1.5, 1.0]
    rows = longtail_rows(400)
    words = sorted(len(r["prompt"].split()) - 2 for r in rows)                           # "Review:" and "Verdict:"
    assert rows == longtail_rows(400) and words[0] >= 6 and words[-1] <= 900
    assert 25 <= words[200] <= 45 and words[-1] > 10 * words[200]                          # median ~33, a long tail
