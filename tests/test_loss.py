"""Tail loss against an independent reference of the seed's formula; padding invariance; no [B, T, V]."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scale import loss as L
from scale.config import ModelConfig
from scale.data import Collator, Example
from scale.modeling import load_base

N = 3


@pytest.fixture(scope="module")
def model():
    m = load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=300, seed=0)
    return m.eval()


def _examples(seed=0, lengths=(5, 9, 4, 12)):
    g = torch.Generator().manual_seed(seed)
    return [Example(torch.randint(3, 300, (n,), generator=g).tolist(), i % 2, 7) for i, n in enumerate(lengths)]


def seed_reference(model, input_ids, attention_mask, threshold, weights=None):
    """The seed's loss on a LEFT-padded batch: full [B, T, V] logits, then the last `threshold` predictions."""
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


@torch.no_grad()
def test_tail_loss_equals_seed_formula_left_padded(model):
    batch = Collator(0, "left")(_examples())
    ref = seed_reference(model, batch["input_ids"], batch["attention_mask"], N)
    tail_logits, targets = L.forward_tail(model, batch, N, "left")
    num, den = L.tail_loss(tail_logits, targets, torch.ones(4, N))
    assert den.item() == 4 * N
    assert abs((num / den).item() - ref.item()) <= 1e-6 * max(1.0, abs(ref.item()))


@torch.no_grad()
def test_weighted_by_type_equals_reference(model):
    batch = Collator(0, "left")(_examples(1))
    w = L.token_weights(batch["type_indicator"], N, [0.25, 2.0])
    assert w.shape == (4, N) and w[0, 0].item() == 0.25 and w[1, 2].item() == 2.0
    ref = seed_reference(model, batch["input_ids"], batch["attention_mask"], N, weights=w)
    num, den = L.tail_loss(*L.forward_tail(model, batch, N, "left"), w)
    assert den.item() == pytest.approx(3 * (0.25 * 2 + 2.0 * 2))
    assert abs((num / den).item() - ref.item()) <= 1e-6 * max(1.0, abs(ref.item()))


@torch.no_grad()
def test_same_example_same_loss_under_left_and_right_padding(model):
    examples = _examples(2)
    left, right = Collator(0, "left")(examples), Collator(0, "right")(examples)
    assert not torch.equal(left["input_ids"], right["input_ids"])
    ll, lt = L.forward_tail(model, left, N, "left")
    rl, rt = L.forward_tail(model, right, N, "right")
    assert torch.equal(lt, rt)
    torch.testing.assert_close(ll, rl, rtol=0, atol=1e-5)
    ln, ld = L.tail_loss(ll, lt, torch.ones(4, N))
    rn, rd = L.tail_loss(rl, rt, torch.ones(4, N))
    assert abs(ln.item() - rn.item()) <= 1e-6 * abs(ln.item()) and ld.item() == rd.item()
    # Each row alone (no padding at all) gives the same tail predictions too.
    for b, ex in enumerate(examples):
        single = Collator(0, "left")([ex])
        sl, _ = L.forward_tail(model, single, N, "left")
        torch.testing.assert_close(sl[0], ll[b], rtol=0, atol=1e-5)


def test_tail_positions_left_and_right():
    mask_left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    mask_right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert L.tail_positions(mask_left, 2).tolist() == [[4, 5], [4, 5]]
    assert L.tail_positions(mask_right, 2).tolist() == [[2, 3], [4, 5]]


def test_tail_positions_rejects_short_rows():
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"row 0 has 3 real tokens; the tail loss needs at least loss.threshold \+ 1 = 4"):
        L.tail_positions(mask, 3)


def test_target_stats_logprob_and_accuracy():
    V = 10
    logits = torch.zeros(2, 2, V)
    logits[0, 0, 4] = 3.0   # row 0 predicts label token 4 (its target)
    logits[1, 0, 4] = 3.0   # row 1 also predicts 4, but its target is 6
    stats = L.target_stats(logits, torch.tensor([4, 6]), torch.tensor([4, 6]), position=-2)
    expected0 = torch.log_softmax(logits[0, 0], -1)[4]
    assert stats.logprob[0].item() == pytest.approx(expected0.item(), abs=1e-6)
    assert stats.correct.tolist() == [1.0, 0.0]


def my_criterion(logits, labels):
    return F.cross_entropy(logits, labels)   # a mean, as the seed's criterion returned


def my_typed_criterion(logits, labels, type_indicator):
    return F.cross_entropy(logits, labels, reduction="none") * (1 + type_indicator.float())


def test_user_criterion_by_import_path():
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 2, 11), torch.randint(0, 11, (3, 2))
    fn = L.load_criterion("tests.test_loss:my_criterion")
    num, den = L.tail_loss(logits, targets, torch.ones(3, 2), criterion=fn)
    ref = F.cross_entropy(logits.reshape(6, 11), targets.reshape(6))
    assert den.item() == 6 and (num / den).item() == pytest.approx(ref.item(), rel=1e-6)
    typed = L.load_criterion("tests.test_loss:my_typed_criterion")
    types = torch.tensor([0, 1, 0])
    num, den = L.tail_loss(logits, targets, torch.ones(3, 2), types, typed, "input")
    ce = F.cross_entropy(logits.reshape(6, 11), targets.reshape(6), reduction="none")
    assert num.item() == pytest.approx((ce * torch.tensor([1, 1, 2, 2, 1, 1.0])).sum().item(), rel=1e-6)
    with pytest.raises(ValueError, match="loss.criterion='tests.test_loss:nope' cannot be imported"):
        L.load_criterion("tests.test_loss:nope")
