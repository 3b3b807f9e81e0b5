"""Gradient accumulation is exact: the same 8 examples give the same update whatever the micro-batching.

Plain SGD, so the weight change is ``-lr * gradient`` (Adam's first step is nearly blind to gradient scale).
LoRA B starts at 0, so after one step its change is exactly ``-lr * dL/dB``.
"""

from __future__ import annotations

from safetensors.torch import load_file

from scale.train import run
from tests.bounds import TINY_JOB_REL
from tests.conftest import tiny_cfg

COMMON = ("data.max_train_examples=8", "optim.name=sgd", "optim.lr=0.5", "optim.warmup_steps=0",
          "optim.schedule=constant", "optim.max_grad_norm=null", "train.log_every=1", "train.eval_every=0",
          "model.gradient_checkpointing=false")


def _run(tmp_path, name, mb, ga, steps):
    out = tmp_path / name
    run(tiny_cfg(out, *COMMON, f"train.micro_batch_size={mb}", f"train.gradient_accumulation_steps={ga}",
                 f"train.max_steps={steps}"))
    return load_file(out / "adapter" / "adapter_model.safetensors")


def _max_rel(a, b):
    """max |a - b| / max |a| over all tensors (weights here are the LoRA adapter after the run)."""
    num = max((a[k] - b[k]).abs().max().item() for k in a)
    den = max(a[k].abs().max().item() for k in a)
    return num / den


def test_one_step_same_update_for_any_micro_batching(tmp_path):
    ref = _run(tmp_path, "mb8_ga1", 8, 1, 1)
    assert any(v.abs().max() > 0 for k, v in ref.items() if "lora_B" in k)
    for mb, ga in [(2, 4), (3, 3), (1, 8)]:   # (3, 3) runs micro-batches of 3, 3 and 2
        got = _run(tmp_path, f"mb{mb}_ga{ga}", mb, ga, 1)
        # One SGD step from lora_B = 0: the weights differ by lr * (the two fp32 gradients' difference), at most
        # TINY_JOB_REL of the largest update (tests/bounds.py), itself at most the largest weight.
        assert _max_rel(ref, got) <= TINY_JOB_REL, (mb, ga, _max_rel(ref, got))


def test_partial_last_window_is_normalised_by_its_own_tokens(tmp_path):
    # 8 examples, (2, 3): window 1 = 6 examples, window 2 = the 2 left over (partial). (6, 1): the same.
    ref = _run(tmp_path, "mb6_ga1", 6, 1, 2)
    got = _run(tmp_path, "mb2_ga3", 2, 3, 2)
    assert _max_rel(ref, got) < 1e-5
    # Scaling the partial window by n/GA (accelerate's default backward) would change the update a lot.
    one = _run(tmp_path, "mb6_ga1_one", 6, 1, 1)
    step2 = {k: ref[k] - one[k] for k in ref}
    assert max(v.abs().max().item() for v in step2.values()) > 1e-3


def test_loss_is_token_weighted_not_mean_of_micro_batch_means(tmp_path):
    # One window of micro-batches 3, 3, 2: train/loss must be the mean over all 16 tail tokens.
    out = tmp_path / "log"
    run(tiny_cfg(out, *COMMON, "train.micro_batch_size=3", "train.gradient_accumulation_steps=3",
                 "train.max_steps=1"))
    from scale.training.metrics import read_jsonl

    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 1 and train[0]["step"] == 1
    out8 = tmp_path / "log8"
    run(tiny_cfg(out8, *COMMON, "train.micro_batch_size=8", "train.max_steps=1"))
    train8 = [r for r in read_jsonl(out8 / "metrics.jsonl") if "train/loss" in r]
    # Step 1 (before any update): two fp32 paths of the same loss and gradient (tests/bounds.py).
    assert abs(train[0]["train/loss"] - train8[0]["train/loss"]) <= TINY_JOB_REL * train8[0]["train/loss"]
    norm8 = train8[0]["train/grad_norm"]
    assert abs(train[0]["train/grad_norm"] - norm8) <= TINY_JOB_REL * norm8
