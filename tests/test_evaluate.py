"""Per-format evaluation: multi-token label ranking equals brute force; exact match; text targets; end-to-end
prompt/completion and chat runs on the tiny model; train.num_epochs sets the step count and the schedule."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from scale.config.load import load_config
from scale.config.schema import DataConfig, LossConfig
from scale.data import Collator, build_splits
from scale.modeling.build import load_base
from scale.objectives.tail import LossSpec
from scale.train import run
from scale.training.evaluate import evaluate
from scale.training.metrics import read_jsonl
from tests.bounds import TINY_JOB_REL  # two fp32 paths of the tiny job (tests/bounds.py)
from tests.conftest import ROOT, TINY_DATA, TINY_YAML, tiny_cfg

TINY_COMPLETIONS = ROOT / "configs" / "data" / "tiny_completions.jsonl"
LABELS = ["very negative", "negative", "positive", "thumbs-up"]


@pytest.fixture(scope="module")
def model(tokenizer):
    from scale.config.schema import ModelConfig

    return load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=len(tokenizer), seed=3).eval()


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _spec(padding_side):
    return LossSpec.from_config(load_config(TINY_YAML, [f"data.padding_side={padding_side}"]))


@torch.no_grad()
def brute_force(model, tokenizer, example, label_seqs, eos=False):
    """Score every label by running prompt + label (+ EOS) alone (no padding, full logits) and summing its
    log-probs."""
    prompt = example.input_ids[:-example.tail_len]
    scores = []
    for seq in label_seqs:
        seq = seq + [tokenizer.eos_token_id] if eos else seq
        ids = torch.tensor([prompt + seq])
        logp = model(input_ids=ids).logits[0].float().log_softmax(-1)          # [T, V]
        scores.append(sum(logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(seq)))
    return scores


@pytest.mark.parametrize("side", ["left", "right"])
def test_multi_token_accuracy_equals_brute_force(tmp_path, tokenizer, model, side):
    rows = [{"text": t, "label": LABELS[i % 4]} for i, t in enumerate(
        json.loads(line)["text"] for line in TINY_DATA.read_text().splitlines()[:24])]
    cfg = DataConfig(labels=LABELS, eval_size=12, padding_side=side)
    path = _write(tmp_path / "d.jsonl", rows)
    splits = build_splits(cfg, LossConfig(), tokenizer, path, seed=0)
    assert splits.label_token_ids is None and [len(s) for s in splits.label_seqs] == [2, 1, 1, 3]
    dl = DataLoader(splits.eval, batch_size=5, collate_fn=Collator(tokenizer.pad_token_id, side))
    got = evaluate(Accelerator(cpu=True), model, dl, _spec(side), task=splits.task)
    correct, nll = 0, 0.0
    for ex in splits.eval:   # issue 17: labels are ranked with the EOS they are trained with
        ranked = brute_force(model, tokenizer, ex, splits.label_seqs, eos=True)
        correct += max(range(4), key=ranked.__getitem__) == ex.label
        nll -= brute_force(model, tokenizer, ex, splits.label_seqs)[ex.label]
    assert got["eval/accuracy"] == correct / 12 and got["eval/examples"] == 12
    assert got["eval/target_nll"] == pytest.approx(nll / 12, rel=TINY_JOB_REL)
    assert set(got) == {"eval/loss", "eval/target_nll", "eval/accuracy", "eval/examples"}


def test_single_token_fast_path_equals_brute_force(tokenizer, model):
    splits = build_splits(DataConfig(eval_size=32), LossConfig(), tokenizer, str(TINY_DATA), seed=0)
    dl = DataLoader(splits.eval, batch_size=7, collate_fn=Collator(tokenizer.pad_token_id, "left"))
    # The call of scripts written when the spec carried evaluation's context: the data's keywords are accepted
    # (unused) and evaluate finds the task the examples of splits.eval carry.
    cfg = load_config(TINY_YAML)
    spec = LossSpec.from_config(cfg)
    assert spec == _spec("left") and splits.eval.task is splits.task
    got = evaluate(Accelerator(cpu=True), model, dl, spec)
    brute = [brute_force(model, tokenizer, ex, splits.label_seqs) for ex in splits.eval]
    assert got["eval/accuracy"] == sum(max(range(2), key=s.__getitem__) == ex.label
                                       for s, ex in zip(brute, splits.eval)) / 32
    assert got["eval/target_nll"] == pytest.approx(-sum(s[ex.label] for s, ex in zip(brute, splits.eval)) / 32,
                                                   rel=TINY_JOB_REL)


@torch.no_grad()
def test_completion_loss_and_exact_match(tokenizer, model):
    splits = build_splits(DataConfig(eval_size=16, max_length=64), LossConfig(), tokenizer, str(TINY_COMPLETIONS),
                          seed=0)
    dl = DataLoader(splits.eval, batch_size=6, collate_fn=Collator(tokenizer.pad_token_id, "right"))
    got = evaluate(Accelerator(cpu=True), model, dl, _spec("right"), task=splits.task)
    num = den = hits = 0.0
    for ex in splits.eval:
        ids = torch.tensor([ex.input_ids])
        logits = model(input_ids=ids).logits[0, -ex.tail_len - 1:-1]
        num += F.cross_entropy(logits, ids[0, -ex.tail_len:], reduction="sum").item()
        den += ex.tail_len
        hits += bool((logits.argmax(-1) == ids[0, -ex.tail_len:]).all())
    assert set(got) == {"eval/loss", "eval/exact_match", "eval/examples"}
    assert got["eval/loss"] == pytest.approx(num / den, rel=TINY_JOB_REL) and got["eval/exact_match"] == hits / 16


def test_text_format_target_nll(tmp_path, tokenizer, model):
    rows = [{"text": f"number {i} is here now", "target": " here"} for i in range(20)]
    splits = build_splits(DataConfig(eval_size=5), LossConfig(threshold=4, target_position=-3), tokenizer,
                          _write(tmp_path / "t.jsonl", rows), seed=0)
    assert splits.format == "text" and splits.has_target
    dl = DataLoader(splits.eval, batch_size=5, collate_fn=Collator(tokenizer.pad_token_id, "left"))
    got = evaluate(Accelerator(cpu=True), model, dl, _spec("left"), task=splits.task)
    here = tokenizer(" here", add_special_tokens=False)["input_ids"][0]
    ref = 0.0
    for ex in splits.eval:
        ids = torch.tensor([ex.input_ids])
        assert ex.input_ids[-3] == here
        ref -= model(input_ids=ids).logits[0, -4].log_softmax(-1)[here].item()   # predicts the 3rd-last token
    assert set(got) == {"eval/loss", "eval/target_nll", "eval/examples"}
    assert got["eval/target_nll"] == pytest.approx(ref / 5, rel=TINY_JOB_REL)


def test_prompt_completion_job_with_epochs(tmp_path):
    """The tiny prompt/completion job by epochs: 40 rows at global batch 16 are 3 windows (16, 16, 8) an epoch,
    so 2 epochs are 6 optimizer steps, and the LR reaches its floor at step 6."""
    out = tmp_path / "pc"
    final = run(tiny_cfg(out, f"data.path={TINY_COMPLETIONS}", "train.max_steps=null", "train.num_epochs=2",
                         "data.max_train_examples=40", "optim.lr=5e-3", "train.eval_every=0", "train.log_every=2",
                         "train.save_adapter=false", "model.gradient_checkpointing=false"))
    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert rows[0] == {"step": 0, "data/train_rows": 40, "data/eval_rows": 32, "data/duplicates_removed": 0,
                       "data/eval_rows_in_train": 4, "data/dropped_long_rows": 0, "data/train_trained_tokens": 226,
                       "data/eval_trained_tokens": 158, "data/train_rows_truncated": 0, "data/eval_rows_truncated": 0}
    assert [r["step"] for r in train] == [2, 4, 6] and [r["step"] for r in evals] == [0, 6]
    assert train[-1]["train/lr"] == pytest.approx(5e-4)          # the cosine floor at the last step
    assert set(evals[0]) == {"step", "eval/loss", "eval/exact_match", "eval/examples", "eval/gen_exact_match",
                             "eval/gen_samples"}   # + the generated samples (issue 20: eval.generate_samples=4)
    samples = read_jsonl(out / "samples.jsonl")
    assert [r["step"] for r in samples] == [0] * 4 + [6] * 4 and evals[0]["eval/gen_samples"] == 4
    for e in evals:  # the metric is the share of this evaluation's samples whose text equals the reference
        assert e["eval/gen_exact_match"] == sum(r["exact"] for r in samples if r["step"] == e["step"]) / 4
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] and final == {k: v for k, v in evals[-1].items()
                                                                        if k != "step"}


@pytest.mark.parametrize("n, mb, ga, world", [(20, 2, 2, 2), (20, 8, 1, 1), (21, 3, 2, 2), (7, 4, 3, 2),
                                              (100, 5, 4, 3), (16, 2, 4, 2), (1, 1, 1, 1)])
def test_steps_for_epochs_counts_the_windows_every_rank_runs(n, mb, ga, world):
    """accelerate deals micro-batches round-robin to the ranks; an epoch ends when no rank has a batch left,
    in windows of ga micro-batches: the loop's count equals ceil(n / global_batch_size) in every mode."""
    from scale.training.schedule import steps_for_epochs

    batches = -(-n // mb)
    per_rank = [len(range(r, batches, world)) for r in range(world)]
    windows = -(-max(per_rank) // ga)
    assert steps_for_epochs(n, mb * ga * world, 3) == 3 * windows
