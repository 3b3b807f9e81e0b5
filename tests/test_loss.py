"""Tail loss against independent full-logits references: the original loop's fixed-N formula, per-row tails of different
lengths, left and right padding, type weights, a user criterion; the LM head never sees [B, T, V]."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scale.config.schema import ModelConfig
from scale.data import Collator, Example
from scale.data.tasks.base import exact_match
from scale.data.tasks.classification import sequence_logprob, target_stats
from scale.loss import tail as scale_loss
from scale.modeling.build import load_base

N = 3


@pytest.fixture(scope="module")
def model():
    m = load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=300, seed=0)
    return m.eval()


def _examples(seed=0, lengths=(5, 9, 4, 12), tails=None):
    g = torch.Generator().manual_seed(seed)
    tails = tails or [N] * len(lengths)
    return [Example(torch.randint(3, 300, (n,), generator=g).tolist(), t, i % 2, 7, row=100 + i)
            for i, (n, t) in enumerate(zip(lengths, tails))]


def original_reference(model, input_ids, attention_mask, threshold, weights=None):
    """The original loop's loss on a LEFT-padded batch: full [B, T, V] logits, then the last `threshold` predictions."""
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits   # [B, T, V]
    shift_logits = logits[:, -threshold - 1:-1, :]
    shift_labels = input_ids[:, -threshold:]
    ce = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                         reduction="none")
    if weights is None:
        return ce.mean()
    w = weights.reshape(-1)
    return (ce * w).sum() / w.sum()


def row_reference(model, ids, tail_len):
    """One row alone, no padding, full logits: mean CE of its last `tail_len` tokens (nats per token)."""
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0]                                                    # [T, V]
    return F.cross_entropy(logits[-tail_len - 1:-1], x[0, -tail_len:]).item()


def per_row(model, batch, side):
    tail_logits, targets = scale_loss.forward_tail(model, batch, padding_side=side)
    w = scale_loss.token_weights(batch["type_indicator"], batch["tail_mask"], None)
    losses = [scale_loss.tail_loss(tail_logits[b:b + 1], targets[b:b + 1], w[b:b + 1]) for b in range(len(targets))]
    return [(num / den).item() for num, den in losses]


def _close(a, b, rel=1e-6):
    return abs(a - b) <= rel * max(1.0, abs(b))


@torch.no_grad()
def test_tail_loss_equals_original_formula_left_padded(model):
    batch = Collator(0, "left")(_examples())
    ref = original_reference(model, batch["input_ids"], batch["attention_mask"], N)
    tail_logits, targets = scale_loss.forward_tail(model, batch, N, "left")
    num, den = scale_loss.tail_loss(tail_logits, targets, scale_loss.token_weights(batch["type_indicator"], batch["tail_mask"], None))
    assert den.item() == 4 * N
    assert _close((num / den).item(), ref.item())


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_text_format_threshold_10_equals_the_original_formula_per_row(model, side):
    """The `text` format (every tail the last 10 tokens) == last 10 positions, full logits, plain CE, per row."""
    examples = _examples(3, lengths=(11, 25, 14, 40, 19), tails=[10] * 5)
    got = per_row(model, Collator(0, side)(examples), side)
    for g, ex in zip(got, examples):
        assert _close(g, row_reference(model, ex.input_ids, 10)), (g, side)
    if side == "left":  # and the original loop's batch formula over the whole left-padded batch
        batch = Collator(0, "left")(examples)
        ref = original_reference(model, batch["input_ids"], batch["attention_mask"], 10).item()
        assert _close(sum(got) / len(got), ref)


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_tails_of_lengths_1_3_7_equal_a_per_row_full_logits_reference(model, side):
    examples = _examples(4, lengths=(6, 13, 9), tails=[1, 3, 7])
    batch = Collator(0, side)(examples)
    assert batch["tail_mask"].tolist() == [[0] * 6 + [1], [0] * 4 + [1] * 3, [1] * 7]
    got = per_row(model, batch, side)
    for g, ex in zip(got, examples):
        assert _close(g, row_reference(model, ex.input_ids, ex.tail_len)), (g, side)
    # The batch's numerator / denominator is the token-weighted mean over all 11 tail tokens.
    tail_logits, targets = scale_loss.forward_tail(model, batch, padding_side=side)
    num, den = scale_loss.tail_loss(tail_logits, targets, batch["tail_mask"].float())
    assert den.item() == 11
    assert _close((num / den).item(), sum(g * ex.tail_len for g, ex in zip(got, examples)) / 11)


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_lm_head_never_sees_all_positions(model, side):
    """Hook the LM head: with tails of 1, 3 and 7 it gets the tail's positions, never all T of them."""
    seen = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        batch = Collator(0, side)(_examples(4, lengths=(6, 13, 9), tails=[1, 3, 7]))
        scale_loss.forward_tail(model, batch, padding_side=side)
    finally:
        handle.remove()
    T = batch["input_ids"].shape[1]
    # left: the 7 positions before the end; right: the union of the rows' predictor positions,
    # {4} | {9, 10, 11} | {1, ..., 7} (rows of 6, 13 and 9 tokens) = 10 positions.
    assert T == 13 and seen == [(3, 7 if side == "left" else 10, 64)]


@torch.no_grad()
def test_weighted_by_type_equals_reference(model):
    batch = Collator(0, "left")(_examples(1))
    w = scale_loss.token_weights(batch["type_indicator"], batch["tail_mask"], [0.25, 2.0])
    assert w.shape == (4, N) and w[0, 0].item() == 0.25 and w[1, 2].item() == 2.0
    ref = original_reference(model, batch["input_ids"], batch["attention_mask"], N, weights=w)
    num, den = scale_loss.tail_loss(*scale_loss.forward_tail(model, batch, padding_side="left"), w)
    assert den.item() == pytest.approx(3 * (0.25 * 2 + 2.0 * 2))
    assert _close((num / den).item(), ref.item())


@torch.no_grad()
def test_type_weights_times_tail_mask():
    mask = torch.tensor([[0, 0, 1], [1, 1, 1]])
    w = scale_loss.token_weights(torch.tensor([1, 0]), mask, [0.5, 3.0])
    assert w.tolist() == [[0.0, 0.0, 3.0], [0.5, 0.5, 0.5]]


@torch.no_grad()
def test_same_example_same_loss_under_left_and_right_padding(model):
    examples = _examples(2, tails=[1, 3, 2, 3])
    left, right = Collator(0, "left")(examples), Collator(0, "right")(examples)
    assert not torch.equal(left["input_ids"], right["input_ids"])
    ll, lt = scale_loss.forward_tail(model, left, padding_side="left")
    rl, rt = scale_loss.forward_tail(model, right, padding_side="right")
    m = left["tail_mask"].bool()
    assert torch.equal(lt[m], rt[m])
    # Left and right padding sum the same terms in other orders: two fp32 paths (tests/bounds.py), relative to the
    # largest logit; the loss is a sum of CEs over the vocabulary, the same bound relative to its value.
    from tests.bounds import fp32_paths_rel

    rel = fp32_paths_rel(ll.shape[-1], model.config.intermediate_size)
    scale = ll[m].abs().max()
    assert (ll[m] - rl[m]).abs().max() <= rel * scale
    ln, ld = scale_loss.tail_loss(ll, lt, left["tail_mask"].float())
    rn, rd = scale_loss.tail_loss(rl, rt, right["tail_mask"].float())
    assert abs(ln.item() - rn.item()) <= rel * abs(ln.item()) and ld.item() == rd.item() == 9
    # Each row alone (no padding at all) gives the same tail predictions too.
    for b, ex in enumerate(examples):
        sl, _ = scale_loss.forward_tail(model, Collator(0, "left")([ex]), padding_side="left")
        assert (sl[0, -ex.tail_len:] - ll[b, -ex.tail_len:]).abs().max() <= rel * scale


def test_tail_positions_left_and_right():
    mask_left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    mask_right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert scale_loss.tail_positions(mask_left, 2).tolist() == [[4, 5], [4, 5]]
    assert scale_loss.tail_positions(mask_right, 2).tolist() == [[2, 3], [4, 5]]
    # Per-row tails: columns outside a row's tail repeat its first tail position.
    tails = torch.tensor([[0, 1], [1, 1]])
    assert scale_loss.tail_positions(mask_right, tails).tolist() == [[3, 3], [4, 5]]


def test_bad_rows_flags_short_rows_and_gaps():
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    tails = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]])
    assert scale_loss.bad_rows(mask, tails).tolist() == [True, False, True, False]


def test_target_stats_logprob_and_accuracy():
    V = 10
    logits = torch.zeros(2, 2, V)
    logits[0, 0, 4] = 3.0   # row 0 predicts label token 4 (its target)
    logits[1, 0, 4] = 3.0   # row 1 also predicts 4, but its target is 6
    stats = target_stats(logits, torch.tensor([4, 6]), torch.tensor([4, 6]), position=-2)
    expected0 = torch.log_softmax(logits[0, 0], -1)[4]
    assert stats.logprob[0].item() == pytest.approx(expected0.item(), abs=1e-6)
    assert stats.correct.tolist() == [1.0, 0.0]


def test_sequence_logprob_and_exact_match():
    logits = torch.log(torch.tensor([[[0.1, 0.9], [0.7, 0.3], [0.2, 0.8]]]))    # [1, 3, 2]
    targets = torch.tensor([[0, 0, 1]])
    mask = torch.tensor([[0, 1, 1]])
    assert sequence_logprob(logits, targets, mask).item() == pytest.approx(float(torch.log(torch.tensor(0.7 * 0.8))))
    assert exact_match(logits, targets, mask).tolist() == [1.0]                 # column 0 is outside the tail
    assert exact_match(logits, targets, torch.ones(1, 3)).tolist() == [0.0]


def my_criterion(logits, labels):
    return F.cross_entropy(logits, labels)   # a mean, as the original loop's criterion returned


def my_typed_criterion(logits, labels, type_indicator):
    return F.cross_entropy(logits, labels, reduction="none") * (1 + type_indicator.float())


def test_user_criterion_by_import_path():
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 2, 11), torch.randint(0, 11, (3, 2))
    fn = scale_loss.load_criterion("tests.test_loss:my_criterion")
    num, den = scale_loss.tail_loss(logits, targets, torch.ones(3, 2), criterion=fn)
    ref = F.cross_entropy(logits.reshape(6, 11), targets.reshape(6))
    assert den.item() == 6 and (num / den).item() == pytest.approx(ref.item(), rel=1e-6)
    typed = scale_loss.load_criterion("tests.test_loss:my_typed_criterion")
    types = torch.tensor([0, 1, 0])
    num, den = scale_loss.tail_loss(logits, targets, torch.ones(3, 2), types, typed, "input")
    ce = F.cross_entropy(logits.reshape(6, 11), targets.reshape(6), reduction="none")
    assert num.item() == pytest.approx((ce * torch.tensor([1, 1, 2, 2, 1, 1.0])).sum().item(), rel=1e-6)
    with pytest.raises(ValueError, match="loss.criterion='tests.test_loss:nope' cannot be imported"):
        scale_loss.load_criterion("tests.test_loss:nope")


def test_user_criterion_sees_only_tail_tokens():
    """Tails of 1 and 2 in a 2-wide batch: the criterion's mean runs over the 3 real tail tokens only."""
    torch.manual_seed(1)
    logits, targets = torch.randn(2, 2, 11), torch.randint(0, 11, (2, 2))
    mask = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    num, den = scale_loss.tail_loss(logits, targets, mask, criterion=my_criterion)
    keep = mask.reshape(-1).bool()
    ref = F.cross_entropy(logits.reshape(4, 11)[keep], targets.reshape(4)[keep])
    assert den.item() == 3 and (num / den).item() == pytest.approx(ref.item(), rel=1e-6)
