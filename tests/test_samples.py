"""Generation at each evaluation (issue 20): the prompt/reference split of a row, eval/gen_exact_match from real
generated text equal to a direct ``model.generate`` call, the stops, samples.jsonl on resume, and a stop request
honoured between samples."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator

from scale.config.schema import ModelConfig
from scale.data.tasks.base import Example
from scale.modeling.build import load_base
from scale.training.samples import (Generation, Sample, generate_samples, last_answer, pick_samples, sample_metrics,
                                    start_samples_file, write_samples)
from scale.utils.signals import EvalInterrupted


@pytest.fixture(scope="module")
def model(tokenizer):
    return load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=len(tokenizer), seed=5).eval()


def test_last_answer_splits_before_the_last_trained_turn():
    # ids 0..9, tail of 6 (ids 4..9): answer 1 = 4,5 (trained), user turn 6,7 (not), answer 2 = 8,9 (trained)
    prompt, ref = last_answer(list(range(10)), 6, [1, 1, 0, 0, 1, 1])
    assert prompt == [0, 1, 2, 3, 4, 5, 6, 7] and ref == [8, 9]
    prompt, ref = last_answer(list(range(5)), 2, [1, 1])  # a label + EOS: the whole tail
    assert prompt == [0, 1, 2] and ref == [3, 4]
    rows = [Example([1, 2, 3, 4], 2, label=1, row=7), Example([5, 6, 7], 1, row=8)]
    got = pick_samples(rows, 5, ["neg", "pos"])
    assert got == [Sample(7, [1, 2], [3, 4], "pos"), Sample(8, [5, 6], [7], None)]


def _gen(tokenizer, samples, stops, tmp_path, max_new_tokens=64):
    return Generation(samples, tokenizer, stops, max_new_tokens, False, tmp_path / "samples.jsonl")


def test_gen_exact_match_is_computed_from_model_generate(model, tokenizer, tmp_path):
    """Two prompts; the first's reference is what a direct greedy ``model.generate`` produces (so it matches),
    the second's is that text with its last token changed (so it does not): gen_exact_match = 0.5 exactly."""
    eos = tokenizer.eos_token_id
    prompts = [tokenizer("Review: fine film.\nSentiment:")["input_ids"], tokenizer("Hello there")["input_ids"]]
    direct = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             eos_token_id=[eos], pad_token_id=tokenizer.pad_token_id)
        direct.append(out[0, len(p):].tolist())
    assert all(len(d) == 4 and eos not in d for d in direct)   # the random tiny model never says EOS here
    wrong = direct[1][:-1] + [(direct[1][-1] + 1) % len(tokenizer)]
    gen = _gen(tokenizer, [Sample(0, prompts[0], direct[0]), Sample(1, prompts[1], wrong)], [eos], tmp_path)
    records = generate_samples(Accelerator(cpu=True), model, gen)
    texts = [tokenizer.decode(d, skip_special_tokens=True).strip() for d in direct]
    assert [r["completion"] for r in records] == texts                 # the budget is the reference length (4)
    assert [r["exact"] for r in records] == [True, False]
    assert sample_metrics(records) == {"eval/gen_exact_match": 0.5, "eval/gen_samples": 2}
    # A stop token ends the completion: a budget of 5, but stopping at the direct run's first token leaves it alone.
    gen = _gen(tokenizer, [Sample(0, prompts[0], direct[0] + [eos])], [eos, direct[0][0]], tmp_path)
    stopped = generate_samples(Accelerator(cpu=True), model, gen)[0]["completion"]
    assert stopped == tokenizer.decode(direct[0][:1], skip_special_tokens=True).strip() != texts[0]
    # eval.max_new_tokens bounds the budget below the reference's length
    gen = _gen(tokenizer, [Sample(0, prompts[0], direct[0])], [eos], tmp_path, max_new_tokens=1)
    assert generate_samples(Accelerator(cpu=True), model, gen)[0]["completion"] == \
        tokenizer.decode(direct[0][:1], skip_special_tokens=True).strip()


def test_generated_label_accuracy():
    records = [{"exact": True, "completion": "positive", "label": "positive"},
               {"exact": False, "completion": "positive!", "label": " negative "},
               {"exact": False, "completion": "negative", "label": "negative"}]
    assert sample_metrics(records) == {"eval/gen_exact_match": 1 / 3, "eval/gen_accuracy": 2 / 3,
                                       "eval/gen_samples": 3}
    assert sample_metrics([]) == {}


def test_stop_request_ends_generation_between_samples(model, tokenizer, tmp_path):
    asked = []

    def stop():  # true from the second check on
        asked.append(1)
        return len(asked) > 1

    prompts = [tokenizer("one two")["input_ids"]] * 3
    gen = _gen(tokenizer, [Sample(i, p, [1]) for i, p in enumerate(prompts)], [tokenizer.eos_token_id], tmp_path)
    with pytest.raises(EvalInterrupted):
        generate_samples(Accelerator(cpu=True), model, gen, stop)
    assert len(asked) == 3  # before sample 0, after its one token (a budget of 1), before sample 1: no sample 1


def test_stop_request_ends_a_long_generation_between_tokens(model, tokenizer, tmp_path):
    """A signal while a sample is generated ends it at the next token (a sample can take minutes on a CPU), and
    the cut sample is not a record: every rank raises."""
    asked = []

    def stop():  # the check before sample 0, after its first token: false; after its second token: true
        asked.append(1)
        return len(asked) > 2

    prompt = tokenizer("one two")["input_ids"]
    gen = _gen(tokenizer, [Sample(i, prompt, list(range(5, 45))) for i in range(2)], [tokenizer.eos_token_id],
               tmp_path)
    with pytest.raises(EvalInterrupted):
        generate_samples(Accelerator(cpu=True), model, gen, stop)
    assert len(asked) == 4  # before sample 0, after its tokens 1 and 2 (a budget of 40), and before sample 1


def test_samples_file_kept_to_the_checkpoint_on_resume(tmp_path):
    path = tmp_path / "samples.jsonl"
    acc = Accelerator(cpu=True)
    start_samples_file(path, True, None)
    for step in (0, 5, 10):
        write_samples(acc, path, step, [{"sample": 0, "row": 3, "prompt": "p", "reference": "r",
                                         "completion": "c", "exact": False}])
    with open(path, "a") as fh:
        fh.write('{"step": 15, "row": 3, "prom')   # a line cut by a crash
    start_samples_file(path, True, keep_until=5)    # resumed from the step-5 checkpoint
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": s, "row": 3, "prompt": "p", "reference": "r", "completion": "c", "exact": False}
                    for s in (0, 5)]
    start_samples_file(path, True, None)            # a fresh run starts empty
    assert path.read_text() == ""
