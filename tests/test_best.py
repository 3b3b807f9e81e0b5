"""train.keep_best and train.early_stopping_patience (issue 20): the comparison, the rotation that spares the best
checkpoint, the config checks, and the tiny job stopping early with its best checkpoint kept."""

from __future__ import annotations

import json

import pytest

from scale.config.validation import ConfigError
from scale.config.validation import best_mode
from scale.train import run
from scale.training.best import observe, out_of_patience, write_best
from scale.training.checkpoint import list_checkpoints, rotate
from scale.training.metrics import read_jsonl
from scale.training.state import TrainerState
from tests.conftest import tiny_cfg


def _state(step=0):
    return TrainerState(step=step, epoch=0, windows_in_epoch=0, world_size=1)


def test_observe_tracks_the_best_and_the_evaluations_since():
    state = _state()
    trace = []
    for step, loss in [(2, 2.5), (4, 1.9), (6, 2.1), (8, 1.9), (10, float("nan")), (12, 1.7)]:
        state.step = step
        better = observe(state, {"eval/loss": loss, "eval/examples": 32}, "eval/loss")
        trace.append((better, state.best_step, state.evals_since_best))
    # a tie (1.9 at step 8) and a NaN never improve; 1.7 does
    assert trace == [(True, 2, 0), (True, 4, 0), (False, 4, 1), (False, 4, 2), (False, 4, 3), (True, 12, 0)]
    assert state.best_metric == 1.7
    assert out_of_patience(_state(), None) is False
    state.evals_since_best = 3
    assert out_of_patience(state, 3) and not out_of_patience(state, 4)
    acc = _state(2)   # a metric that rises
    assert observe(acc, {"eval/accuracy": 0.5}, "eval/accuracy") and not observe(acc, {"eval/accuracy": 0.4},
                                                                                  "eval/accuracy")
    with pytest.raises(ConfigError, match=r"train.keep_best='eval/accuracy' is not an evaluation metric.*eval/loss"):
        observe(_state(), {"eval/loss": 1.0}, "eval/accuracy")


def test_best_mode_inferred_or_given():
    assert [best_mode(m) for m in ("eval/loss", "eval/target_nll", "eval/accuracy", "eval/gen_exact_match")] == \
        ["min", "min", "max", "max"]
    assert best_mode("eval/custom", "max") == "max"
    with pytest.raises(ConfigError, match="train.keep_best_mode=min or max"):
        best_mode("eval/examples")


@pytest.mark.parametrize("overrides, message", [
    (["train.early_stopping_patience=2"], "train.early_stopping_patience needs train.keep_best"),
    (["train.keep_best=loss"], "must name an evaluation metric"),
    (["train.keep_best=eval/examples"], "train.keep_best_mode=min or max"),
    (["train.keep_best=eval/loss", "train.early_stopping_patience=0"], "must be >= 1"),
    (["eval.generate_samples=-1"], "eval.generate_samples=-1 must be >= 0"),
])
def test_bad_best_settings_name_the_field(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_cfg(tmp_path, *overrides)


def test_rotation_spares_the_best_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / "trainer_state.json").write_text("{}")
    gone = rotate(tmp_path, 1, keep=4)
    assert [p.name for p in gone] == ["step_000002", "step_000006"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000008"]
    state = _state(4)
    state.best_metric, state.best_step = 1.25, 4
    write_best(tmp_path, state, "eval/loss")
    assert json.loads((tmp_path / "best.json").read_text()) == {
        "metric": "eval/loss", "value": 1.25, "step": 4, "checkpoint": str(root / "step_000004")}


@pytest.mark.slow
def test_tiny_job_stops_early_and_keeps_its_best_checkpoint(tmp_path):
    """eval/accuracy of the random tiny model stays at 0.625 for the first steps (measured): the first evaluation
    after step 0 is the best, ties do not improve, so with patience 2 the run stops 2 evaluations later, at step 3
    of 12, with the best (step 1) checkpoint kept beside the final one although save_total_limit=1."""
    out = tmp_path / "run"
    job = ["train.eval_every=1", "train.save_every=0", "train.save_total_limit=1", "train.keep_best=eval/accuracy",
           "train.early_stopping_patience=2", "data.eval_size=16", "eval.generate_samples=0",
           "data.max_train_examples=32", "train.save_adapter=false", "train.gradient_accumulation_steps=1",
           "model.gradient_checkpointing=false", "log.peak_flops=false"]
    final = run(tiny_cfg(out, *job))
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 3] and len({r["eval/accuracy"] for r in evals[1:]}) == 1
    assert [r for r in rows if "train/early_stopped" in r] == [{"step": 3, "train/early_stopped": 1.0}]
    assert [p.name for p in list_checkpoints(out)] == ["step_000001", "step_000003"]
    saved = json.loads((out / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert (saved["reason"], saved["best_step"], saved["evals_since_best"]) == ("early_stopped", 1, 2)
    assert json.loads((out / "best.json").read_text())["step"] == 1
    assert final["eval/accuracy"] == evals[-1]["eval/accuracy"]
    # resumed, an early-stopped run stays stopped: nothing is trained, nothing logged again
    again = run(tiny_cfg(out, *job, "train.resume_from=latest"))
    assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl")) == 3
    assert again["eval/accuracy"] == final["eval/accuracy"]


CHATS = ["--config", "tiny_cpu", "data.format=messages", "data.eval_size=8", "train.max_steps=8",
         "train.micro_batch_size=4", "train.gradient_accumulation_steps=1", "train.eval_every=4",
         "eval.generate_samples=0", "log.trackers=[]"]


@pytest.mark.parametrize("metric, why", [
    ("eval/accuracy", ""),
    ("eval/gen_exact_match", " (eval/gen_* metrics need eval.generate_samples > 0)"),
])
def test_keep_best_metric_the_run_never_reports_is_refused_before_step_1(tmp_path, capsys, metric, why):
    """A chat run reports eval/loss and eval/exact_match; asking to keep the best eval/accuracy used to stop the
    run at its first evaluation after training started (the steps trained lost). Refused at start-up, nothing
    written."""
    from scale.cli import main
    from tests.conftest import ROOT

    out = tmp_path / "out"
    code = main([*CHATS, f"data.path={ROOT / 'configs/data/tiny_chats.jsonl'}", f"output_dir={out}",
                 f"data.chat_template={ROOT / 'configs/chat/chatml.jinja'}", f"data.cache_dir={tmp_path / 'cache'}",
                 f"train.keep_best={metric}"])
    assert code == 2 and not out.exists()
    assert capsys.readouterr().err == (
        f"scale-train: error: ConfigError: train.keep_best='{metric}' is not an evaluation metric of this run{why}; "
        f"it reports ['eval/exact_match', 'eval/examples', 'eval/loss']: set train.keep_best to one of them\n")


def test_the_metrics_a_run_will_report_are_known_before_it_evaluates():
    from scale.config.load import load_config
    from scale.data import tasks
    from scale.objectives.tail import LossSpec
    from scale.training.best import check_reported
    from scale.training.evaluate import metric_names
    from scale.training.samples import Sample, sample_metric_names
    from tests.conftest import TINY_YAML

    spec = LossSpec.from_config(load_config(TINY_YAML))

    def task(fmt, has_target):
        t = tasks.get(fmt)
        t.restore({"has_target": has_target})  # what the data pipeline found in the rows (text: a target column)
        return t

    names = {(fmt, target): metric_names(task(fmt, target), spec)
             for fmt, target in (("classification", False), ("messages", False), ("prompt_completion", False),
                                 ("text", False), ("text", True))}
    base = {"eval/loss", "eval/examples"}
    assert names == {("classification", False): base | {"eval/target_nll", "eval/accuracy"},
                     ("messages", False): base | {"eval/exact_match"},
                     ("prompt_completion", False): base | {"eval/exact_match"},
                     ("text", False): base, ("text", True): base | {"eval/target_nll"}}
    labelled, plain = Sample(3, [1, 2], [5, 6], " positive"), Sample(4, [1, 2], [5, 6])
    assert sample_metric_names([labelled]) == {"eval/gen_exact_match", "eval/gen_accuracy", "eval/gen_samples"}
    assert sample_metric_names([plain]) == {"eval/gen_exact_match", "eval/gen_samples"}
    assert sample_metric_names([]) == set()
    check_reported("eval/gen_exact_match", names[("messages", False)] | sample_metric_names([plain]))
    check_reported(None, set())
