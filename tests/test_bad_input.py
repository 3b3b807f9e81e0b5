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
    rows = [{"text": "ok fine", "row": 17}]  # the text format
    msg = _message(DataError, tokenize_rows, rows, tokenizer, DataConfig(max_length=64),
                   LossConfig(threshold=40, target_position=-2))
    assert msg == ("row 17 has 3 tokens; loss.threshold=40 needs at least 41. Lower loss.threshold, "
                   "raise data.max_length or drop the row.")


def test_label_that_merges_with_the_template(tokenizer):
    msg = _message(DataError, label_token_ids, tokenizer, DataConfig(template="Review: {text}{label}",
                                                                      labels=["s", "ing"]))
    assert msg == ("data.labels: 's' does not tokenize apart from the template text before it in "
                   "data.template='Review: {text}{label}'; put a space or a newline before '{label}'")


def test_label_not_in_label_set(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"text": "fine", "label": "positive"}, {"text": "meh", "label": "neutral"}])
    assert _message(DataError, load_rows, DataConfig(), path) == (
        f"row 1 of {path}: label 'neutral' is not in data.labels=['negative', 'positive']; fix the row or add "
        f"the label to data.labels")


def test_missing_column(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"review": "good", "label": "positive"}])
    assert _message(DataError, load_rows, DataConfig(), path) == (
        f"{path} has the columns ['review', 'label'], which fit no data format: messages needs messages (no "
        f"'messages'); prompt_completion needs prompt, completion (no 'prompt', 'completion'); classification needs "
        f"text, label (no 'text'); text needs text (+ type, target) (no 'text'). Rename the columns, set "
        f"data.*_column, or set data.format")


def test_misspelled_column(tmp_path):
    """A text,label file with a misspelled data.label_column is an error, not silently the text format."""
    path = _write(tmp_path / "d.jsonl", [{"text": "good", "label": "positive"}])
    assert _message(DataError, load_rows, DataConfig(label_column="lable"), path) == (
        f"{path} has the columns ['text', 'label'], which fit no data format: messages needs messages (no "
        f"'messages'); prompt_completion needs prompt, completion (no 'prompt', 'completion'); classification needs "
        f"text, lable (no 'lable'); text needs text (+ type, target) (other columns ['label']: set data.format=text)."
        f" Rename the columns, set data.*_column, or set data.format")
    assert _message(DataError, load_rows, DataConfig(format="prompt_completion"), path) == (
        f"data.format=prompt_completion needs the columns ['prompt', 'completion'] but {path} has ['text', "
        f"'label']; rename the columns or set data.*_column (data.column_names for a header-less file)")


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


def test_label_that_tokenizes_differently_in_a_row(tokenizer):
    cfg = DataConfig(template="Review: {text}{label}", labels=["ok", "no"])
    rows = [{"text": "no", "label": "ok", "row": 3}]
    assert _message(DataError, tokenize_rows, rows, tokenizer, cfg, LossConfig()) == (
        "row 3: the label 'ok' tokenizes as ['ook'] at the end of this row, not as ['ok']; put a space or newline "
        "before '{label}' in data.template")


def test_micro_batch_larger_than_a_rank_shard(tmp_path):
    msg = _message(DataError, run, tiny_cfg(tmp_path, "data.max_train_examples=6", "train.micro_batch_size=8"))
    assert msg == ("train.micro_batch_size=8 x num_processes=1 is larger than the train split (6 rows): a rank's "
                   "shard would hold less than one micro-batch. Lower train.micro_batch_size to at most 6 or add "
                   "data.")


# ---- config ----

@pytest.mark.parametrize("override, message", [
    ("train.max_steps=ten", "train.max_steps='ten' has the wrong type: expected int | None"),
    ("train.num_epochs=2", ("train.max_steps=12 and train.num_epochs=2 are both set; set exactly one "
                            "(train.max_steps=null to train by epochs)")),
    ("train.max_steps=null", "set train.max_steps or train.num_epochs (exactly one): how long to train"),
    ("data.format=chat", ("data.format='chat' is not one of ['auto', 'text', 'classification', "
                          "'prompt_completion', 'messages']")),
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
        "train.max_steps='a: b' has the wrong type: expected int | None")


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


# ---- data formats (issue 10): one line, exit 2, nothing written ----

def _cli(tmp_path, capsys, *overrides):
    """Run scale-train on the tiny job; return (exit code, stderr) and check nothing was written."""
    from scale.cli import main

    out = tmp_path / "out"
    code = main(["--config", str(TINY_YAML), f"output_dir={out}", *overrides])
    err = capsys.readouterr().err
    assert not out.exists(), "a rejected run must write nothing"
    assert err.count("\n") == 1 and "Traceback" not in err
    return code, err.removeprefix("scale-train: error: DataError: ").rstrip("\n")


def _hi(answer="Hello."):
    return [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]


@pytest.mark.parametrize("rows, overrides, message", [
    ([{"instruction": "Add", "input": "2+2", "output": "4"}], [],
     ("{path} has the columns ['instruction', 'input', 'output'], which fit no data format: messages needs "
      "messages (no 'messages'); prompt_completion needs prompt, completion (no 'prompt', 'completion'); "
      "classification needs text, label (no 'text', 'label'); text needs text (+ type, target) (no 'text'). "
      "Rename the columns, set data.*_column, or set data.format")),
    ([{"prompt": "Q", "completion": "A"}, {"prompt": "Q2", "completion": "  "}], [],
     "row 1 of {path}: empty 'completion'"),
    ([{"messages": _hi()}, {"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi"}]}], [],
     ("row 1 of {path}: no assistant message; the messages format trains the last assistant turn, so every "
      "conversation needs one")),
    ([{"messages": _hi() + [{"role": "user", "content": "And?"}]}], [],
     ("row 0 of {path}: the last message is from 'user', not 'assistant'; the messages format trains the last "
      "assistant turn, so end every conversation with it")),
    ([{"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Yo"}]}], [],
     ("row 0 of {path}: message 1 must be {{'role': one of ['system', 'user', 'assistant', 'tool'], 'content': "
      "text}}, got {{'role': 'bot', 'content': 'Yo'}}")),
    ([{"prompt": "Q", "completion": " A"}] * 40 + [{"prompt": "Q", "completion": " one two three four five six"}],
     ["data.max_length=6", "data.eval_size=4"],
     ("row 40: the trained tail is 7 tokens; with 1 token(s) before it the row needs 8 > data.max_length=6. "
      "Raise data.max_length, or set data.drop_long_completions=true to drop such rows (counted in the log).")),
    ([{"messages": _hi()}] * 40, ["data.chat_template=/nonexistent/chat.jinja"],
     "data.chat_template='/nonexistent/chat.jinja' is not a file; point it at a Jinja chat-template file"),
])
def test_format_errors_exit_2_before_anything_is_written(tmp_path, capsys, rows, overrides, message):
    path = _write(tmp_path / "d.jsonl", rows)
    code, err = _cli(tmp_path, capsys, f"data.path={path}", *overrides)
    assert code == 2 and err == message.format(path=path)


def test_no_chat_template(tmp_path, capsys, tokenizer):
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    for f in tok_dir.glob("chat_template*"):
        f.unlink()
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    path = _write(tmp_path / "d.jsonl", [{"messages": _hi()}] * 40)
    code, err = _cli(tmp_path, capsys, f"data.path={path}", f"model.tokenizer={tok_dir}")
    assert code == 2 and err == (
        "the messages format needs a chat template and this tokenizer has none; set data.chat_template to a Jinja "
        "file (e.g. the chat_template of a tokenizer_config.json of the same model family), or write the data as "
        "prompt/completion columns")


def test_long_completions_dropped_and_counted(tmp_path, tokenizer):
    from scale.data import build_splits

    rows = [{"prompt": f"Q{i}", "completion": " A"} for i in range(20)] + [{"prompt": "Q", "completion": " " + "x " * 9}]
    path = _write(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(max_length=6, eval_size=4, drop_long_completions=True)
    splits = build_splits(cfg, LossConfig(), tokenizer, path, seed=0)
    assert splits.stats["data/dropped_long_rows"] == 1 and len(splits.train) + len(splits.eval) == 20


# ---- files read as they are (issue 11 item 4) ----

def test_csv_quote_that_swallows_lines(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('text,label\ngood film,positive\n"bad film\nok film\nfine",positive\nmeh,negative\n',
                    encoding="utf-8")
    assert _message(DataError, load_rows, DataConfig(), str(path)) == (
        f"row 1 of {path} (line 3) runs on to line 5: a quoted cell holds 2 line break(s), so the lines after it "
        f"became part of one row. Double a literal quote inside a quoted cell (\"\"), or write the data as .jsonl")


@pytest.mark.parametrize("text, message", [
    ('text,label\ngood film,positive\n"bad film,negative\nok film,positive\n', "unexpected end of data"),
    ('text,label\ngood film,positive\n"bad" film,negative\n', "',' expected after '\"'"),
])
def test_csv_quote_that_does_not_close(tmp_path, text, message):
    path = tmp_path / "d.csv"
    path.write_text(text, encoding="utf-8")
    assert _message(DataError, load_rows, DataConfig(), str(path)) == (
        f"row 1 of {path} (line 3) cannot be parsed as CSV ({message}): a quote opened in it does not close where "
        f"its cell ends. Double a literal quote inside a quoted cell (\"\"), or write the data as .jsonl")


def test_csv_row_with_another_number_of_cells(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("text,label\ngood, film,positive\n", encoding="utf-8")
    assert _message(DataError, load_rows, DataConfig(), str(path)) == (
        f"row 0 of {path} (line 2) has 3 cells but the header has 2 (['text', 'label']); fix the row or its "
        f"delimiters")


def test_jsonl_line_that_is_not_json(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "label": "positive"}\n{"text": "b", label: "negative"}\n', encoding="utf-8")
    assert _message(DataError, load_rows, DataConfig(), str(path)) == (
        f"line 2 of {path} is not JSON (Expecting property name enclosed in double quotes); write one JSON object "
        f"per line")


# ---- forward_tail checks its rows under either padding (issue 11) ----

@pytest.mark.parametrize("side", ["left", "right"])
def test_forward_tail_checks_row_lengths_and_gaps(side):
    import torch

    from scale.loss import forward_tail

    def batch(mask, tails):
        mask = torch.tensor(mask)
        return {"input_ids": torch.ones_like(mask), "attention_mask": mask, "tail_mask": torch.tensor(tails),
                "row": torch.tensor([7, 9])}

    short = batch([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]] if side == "left" else [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]],
                  [[1, 1], [1, 1]])
    assert _message(ValueError, forward_tail, None, short, None, side) == (
        "row 0 of the batch (data-file row 7) has 2 real tokens; its tail of 2 tokens needs at least 3 (each tail "
        "token is predicted from the token before it). Lower loss.threshold or drop short rows.")
    gap = batch([[1, 1, 1, 1, 1], [1, 0, 1, 1, 1]], [[0, 1], [0, 1]])
    assert _message(ValueError, forward_tail, None, gap, None, side) == (
        "attention_mask row 1 of the batch (data-file row 9) is not one contiguous run of 1s (left or right "
        "padding)")


def test_training_windows_check_rows_inside_their_all_gather():
    """The loop checks every micro-batch's rows in the per-step all-gather (no extra host sync, every rank stops)."""
    from types import SimpleNamespace

    import torch

    from scale.loss import LossSpec
    from scale.train import windows

    spec = LossSpec(threshold=2, padding_side="left", type_weights=None, criterion=None, criterion_mode="plain",
                    target_position=-2, label_token_ids=None)
    good = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long),
            "tail_mask": torch.ones(2, 2, dtype=torch.long), "type_indicator": torch.zeros(2, dtype=torch.long),
            "row": torch.tensor([3, 4])}
    bad = {**good, "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]), "row": torch.tensor([5, 6])}
    acc = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t)
    assert [len(w.micro) for w in windows(acc, [good, good], 2, spec)] == [2]
    assert _message(ValueError, lambda: list(windows(acc, [good, bad], 2, spec))) == (
        "row 1 of the batch (data-file row 6) has 2 real tokens; its tail of 2 tokens needs at least 3 (each tail "
        "token is predicted from the token before it). Lower loss.threshold or drop short rows.")
