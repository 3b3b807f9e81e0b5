"""lm-evaluation-harness on merged/ with the task scale/lmeval.py writes from the run's eval split (no hub) gives the
run's own figures: on the classification job the harness's accuracy is the run's eval/accuracy and its mean gold
log-likelihood is -eval/target_nll; on a chat run its greedy answers are samples.jsonl's, row by row."""

from __future__ import annotations

import json

import pytest

from scale.generation.export import merge_run
from scale.lmeval import evaluate, last_eval, main, task_name
from scale.train import run
from tests.bounds import TINY_JOB_REL  # two fp32 paths of the tiny job (tests/bounds.py)
from tests.conftest import tiny_cfg


@pytest.mark.slow
def test_lm_eval_accuracy_is_the_runs_eval_accuracy(tmp_path, capsys):
    out = tmp_path / "cls"
    # tiny reviews, 32 held out; a 128-wide tiny Llama after 4 steps still ranks the labels row by row (longer
    # training of this LoRA collapses it to one label for every row, which would make equal accuracies trivial)
    run(tiny_cfg(out, "model.tiny_hidden_size=128", "model.tiny_intermediate_size=256", "train.max_steps=4",
                 "train.eval_every=0"))
    assert main([str(out)]) == 2  # no merged/ yet: one line naming the fix
    assert f"run `scale-export {out}` first" in capsys.readouterr().err
    merge_run(out)
    final = last_eval(out)
    summary = evaluate(out, batch_size=16)
    name = task_name(out)
    assert name == "scale_cls" and summary["kind"] == "multiple_choice"
    assert summary["docs"] == final["eval/examples"] == 32 and summary["mismatched"] == 0
    docs = [json.loads(x) for x in (out / "lm_eval" / f"{name}.jsonl").read_text().splitlines()]
    assert docs[0]["choices"] == [" negative", " positive"] and docs[0]["context"].endswith("\nSentiment:")
    samples = summary["samples"][name]
    lls = [[r[0] for r in s["filtered_resps"]] for s in samples]
    predicted = [max(range(2), key=ll.__getitem__) for ll in lls]
    assert 0 < sum(predicted) < 32  # both labels are predicted somewhere: the ranking is row by row
    correct = [p == s["target"] for p, s in zip(predicted, samples)]
    assert summary["results"][name]["acc,none"] == sum(correct) / 32 == final["eval/accuracy"]
    gold = [ll[s["target"]] for ll, s in zip(lls, samples)]  # the label token's log-probability, nats
    assert -sum(gold) / 32 == pytest.approx(final["eval/target_nll"], rel=TINY_JOB_REL)
    written = json.loads((out / "lm_eval" / "results.json").read_text())
    assert written["run"] == {"step": 4, "eval/accuracy": final["eval/accuracy"]}
    assert written["results"][name]["acc,none"] == final["eval/accuracy"]


@pytest.mark.slow
def test_lm_eval_generates_the_runs_samples(chat_run):
    out, _, _ = chat_run
    summary = evaluate(out, batch_size=8)
    name = task_name(out)
    assert summary["kind"] == "generate_until" and summary["docs"] == 8 and summary["mismatched"] == 0
    final = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines() if json.loads(x)["step"] == 30]
    assert len(final) == 8  # eval.generate_samples=8: every held-out row, in the eval split's order
    by_row = {s["doc"]["row"]: s for s in summary["samples"][name]}
    for record in final:
        s = by_row[record["row"]]
        assert s["doc"]["context"] == record["prompt"] and s["doc"]["reference"] == record["reference"]
        assert s["filtered_resps"][0].strip() == record["completion"]
    assert summary["results"][name]["exact_match,none"] == last_eval(out)["eval/gen_exact_match"]


def test_runs_without_an_answer_to_score_are_refused(tmp_path, capsys):
    from scale.config.load import dump_config

    assert main([str(tmp_path), "--write-only"]) == 2
    assert capsys.readouterr().err == f"scale-lm-eval: error: {tmp_path} has no config.yaml: give the directory of a " \
                                      f"trained run\n"
    dump_config(tiny_cfg(tmp_path, "data.format=text"), tmp_path / "config.yaml")
    assert main([str(tmp_path), "--write-only"]) == 2
    err = capsys.readouterr().err
    assert "data.format=text rows have no held-out answer to score" in err and err.count("\n") == 1
    assert not (tmp_path / "lm_eval").exists()
