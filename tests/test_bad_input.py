"""The bad-input catalogue: every entry fails before training with the exact message, naming the field and
the fix. Data and config entries run in milliseconds; launch and resume entries build real objects.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from scale.checkpoint import CheckpointError, list_checkpoints
from scale.config import ConfigError, DataConfig, LossConfig, load_config
from scale.data import DataError, label_token_ids, load_rows, tokenize_rows
from scale.launch import LaunchError, plan_for_mode, reconcile_deepspeed
from scale.train import run
from tests.conftest import TINY_YAML, tiny_cfg


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _message(exc_type, fn, *args):
    with pytest.raises(exc_type) as e:
        fn(*args)
    return str(e.value)


# ---- data ----

def test_row_shorter_than_threshold_plus_one(tokenizer):
    rows = [{"text": "ok", "label": "positive", "row": 17}]
    n = len(tokenizer("Review: ok\nSentiment: positive")["input_ids"]) + 1  # + EOS
    msg = _message(DataError, tokenize_rows, rows, tokenizer, DataConfig(max_length=64),
                   LossConfig(threshold=40, target_position=-2))
    assert msg == (f"row 17 has {n} tokens; loss.threshold=40 needs at least 41. Lower loss.threshold, "
                   f"raise data.max_length or drop the row.")


def test_label_word_of_several_tokens(tokenizer):
    msg = _message(DataError, label_token_ids, tokenizer, DataConfig(labels=["negative", "thumbs-up"]))
    assert msg == ("data.labels: 'thumbs-up' renders as 3 tokens [' thumbs', '-', 'up'] in data.template; "
                   "every label word must be a single token: choose another word")


def test_label_not_in_label_set(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"text": "fine", "label": "positive"}, {"text": "meh", "label": "neutral"}])
    assert _message(DataError, load_rows, DataConfig(), path) == (
        f"row 1 of {path}: label 'neutral' is not in data.labels=['negative', 'positive']; fix the row or add "
        f"the label to data.labels")


def test_missing_column(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"review": "good", "label": "positive"}])
    assert _message(DataError, load_rows, DataConfig(), path) == (
        f"data.text_column='text' is not a column of {path}; its columns are ['review', 'label']. Set "
        f"data.text_column (or data.column_names for a header-less file).")


def test_misspelled_column(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"text": "good", "label": "positive"}])
    assert _message(DataError, load_rows, DataConfig(label_column="lable"), path) == (
        f"data.label_column='lable' is not a column of {path}; its columns are ['text', 'label']. Set "
        f"data.label_column (or data.column_names for a header-less file).")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert _message(DataError, load_rows, DataConfig(), str(path)) == (
        f"data.path={str(path)!r} is empty; it needs at least one labelled row")


def test_non_utf8_file(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("text,label\ncaf\xe9 film,positive\n".encode("latin-1"))
    assert _message(DataError, load_rows, DataConfig(), str(path)) == (
        f"data.path={str(path)!r} is not UTF-8 (byte 14); re-encode it as UTF-8")


def test_label_not_at_target_position(tokenizer):
    rows = [{"text": "good film", "label": "positive", "row": 3}]
    msg = _message(DataError, tokenize_rows, rows, tokenizer, DataConfig(), LossConfig(threshold=3,
                                                                                         target_position=-3))
    assert msg == ("row 3: the token at loss.target_position=-3 is ':', not the label 'positive'; set "
                   "loss.target_position to where the label sits")


def test_micro_batch_larger_than_a_rank_shard(tmp_path):
    msg = _message(DataError, run, tiny_cfg(tmp_path, "data.max_train_examples=6", "train.micro_batch_size=8"))
    assert msg == ("train.micro_batch_size=8 x num_processes=1 is larger than the train split (6 rows): a rank's "
                   "shard would hold less than one micro-batch. Lower train.micro_batch_size to at most 6 or add "
                   "data.")


# ---- config ----

@pytest.mark.parametrize("override, message", [
    ("train.max_steps=ten", "train.max_steps='ten' has the wrong type: expected int"),
    ("model.quantize_4bit=maybe", "model.quantize_4bit='maybe' has the wrong type: expected bool"),
    ("loss.target_position=-3", "loss.target_position=-3 is outside the tail: it must be between -2 and -1 "
                                "(loss.threshold=2); raise loss.threshold or move it"),
    ("train.on_nonfinite=ignore", "train.on_nonfinite='ignore' is not one of ['error', 'skip']"),
    ("train.save_total_limit=0", "train.save_total_limit=0 must be >= 1, or null to keep all"),
])
def test_config_value_errors(override, message):
    assert _message(ConfigError, load_config, TINY_YAML, [override]) == message


def test_misspelled_config_key():
    msg = _message(ConfigError, load_config, TINY_YAML, ["train.max_stpes=5"])
    assert msg.startswith("unknown config key train.max_stpes; known keys in train: ")


# ---- launch config vs training config ----

def test_deepspeed_json_contradicts_training_config():
    cfg = load_config(TINY_YAML, ["train.gradient_accumulation_steps=2"])
    assert _message(LaunchError, reconcile_deepspeed, cfg, {"gradient_accumulation_steps": 4}) == (
        'the DeepSpeed config sets gradient_accumulation_steps=4 but the training config has 2 (train.*/optim.*); '
        'set it to "auto" in the JSON so the training config owns it')


def _acc(dt, zero=None, n=2):
    plugin = SimpleNamespace(zero_stage=zero)
    return SimpleNamespace(distributed_type=dt, num_processes=n, state=SimpleNamespace(deepspeed_plugin=plugin),
                           device=SimpleNamespace(type="cpu"), local_process_index=0)


@pytest.mark.parametrize("overrides, acc, message", [
    (["model.use_reentrant=true"], _acc(DistributedType.MULTI_GPU),
     "model.use_reentrant=true with LoRA under data parallelism fails with 'marked ready twice' (peft#313, "
     "trl#921); set model.use_reentrant=false"),
    (["train.on_nonfinite=skip"], _acc(DistributedType.DEEPSPEED, zero=2),
     "train.on_nonfinite=skip cannot work under DeepSpeed: its optimizer steps inside backward(), before the loop "
     "sees the gradient norm; use train.on_nonfinite=error"),
    (["model.quantize_4bit=true"], _acc(DistributedType.DEEPSPEED, zero=3),
     "zero3 shards 4-bit weights only when model.bnb_4bit_quant_storage equals the compute dtype; set "
     "model.bnb_4bit_quant_storage=float32"),
])
def test_launch_mode_contradicts_training_config(overrides, acc, message):
    assert _message(LaunchError, plan_for_mode, load_config(TINY_YAML, overrides), acc) == message


# ---- resume ----

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    run(tiny_cfg(out, "train.max_steps=2", "train.save_every=2", "train.save_adapter=false"))
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return list_checkpoints(out)[-1]


def test_resume_from_another_world_size(checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["world_size"] = 2
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    msg = _message(CheckpointError, run, tiny_cfg(tmp_path, "train.max_steps=2", f"train.resume_from={ckpt}"))
    assert msg == (f"checkpoint {ckpt} was written by 2 processes, this run has 1: the data shards and the global "
                   f"batch would change. Launch with num_processes=2.")


def test_resume_where_a_rank_cannot_see_the_checkpoint(checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "random_states_0.pkl").unlink()  # what a node without shared storage sees
    msg = _message(CheckpointError, run, tiny_cfg(tmp_path, "train.max_steps=2", f"train.resume_from={ckpt}"))
    host = __import__("os").uname().nodename
    assert msg == (f"rank 0 on {host} cannot read checkpoint {ckpt}: missing ['{ckpt}/random_states_0.pkl']. "
                   f"Without shared storage set train.save_on_each_node=true (then each node writes its own copy) "
                   f"or copy the checkpoint to every node before resuming.")


def test_resume_refuses_pickled_code(checkpoint, tmp_path):
    """Checkpoints load with weights_only: a pickle that would run code is refused, and the code never runs."""
    import pickle

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {marker}",))

    (ckpt / "optimizer.bin").write_bytes(pickle.dumps({"state": Payload()}))
    with pytest.raises(Exception, match="Weights only load failed"):
        run(tiny_cfg(tmp_path, "train.max_steps=2", f"train.resume_from={ckpt}"))
    assert not marker.exists()


def test_data_path_that_is_a_directory(tmp_path):
    assert _message(DataError, load_rows, DataConfig(), str(tmp_path)) == (
        f"data.path={str(tmp_path)!r} is a directory; point it at a .jsonl/.csv/.tsv file (a relative path is read "
        f"from the current directory)")


def test_override_text_with_a_colon_stays_text():
    """`data.template='Text: {text}...'` is a string, not the YAML mapping {'Text': '{text}...'}."""
    cfg = load_config(TINY_YAML, ["data.template=Text: {text}\nVerdict: {label}", "lora.target_modules=[q_proj]"])
    assert cfg.data.template == "Text: {text}\nVerdict: {label}" and cfg.lora.target_modules == ["q_proj"]
    assert _message(ConfigError, load_config, TINY_YAML, ["train.max_steps=a: b"]) == (
        "train.max_steps='a: b' has the wrong type: expected int")


def test_cli_prints_the_message_and_exits_2(tmp_path, capsys):
    from scale.cli import EXIT_BAD_INPUT, main

    assert main(["--config", str(TINY_YAML), "train.max_stpes=5"]) == EXIT_BAD_INPUT == 2
    err = capsys.readouterr().err
    assert err.startswith("scale-train: error: ConfigError: unknown config key train.max_stpes; known keys in train")
    assert "Traceback" not in err
    assert main(["--config", str(TINY_YAML), f"output_dir={tmp_path}", "data.path=nowhere.jsonl"]) == 2
    assert capsys.readouterr().err == ("scale-train: error: DataError: data.path='nowhere.jsonl' does not exist; "
                                       "point it at a .jsonl/.csv/.tsv file (a relative path is read from the "
                                       "current directory)\n")
