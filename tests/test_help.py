"""Keys that explain themselves: ``scale-train --help [SECTION|KEY|trl]``, the closest keys to a typo, TRL and
transformers names mapped to scale keys, nested sweep values merged key by key, ``optim.warmup_ratio``."""

from __future__ import annotations

import math
import re

import pytest

from scale.cli import main, parse_args
from scale.config.help import keys_help
from scale.config.load import load_config
from scale.config.names import TRL_NAMES, all_keys, differences_from_trl, schema_fields, suggest
from scale.config.validation import ConfigError
from scale.training.schedule import lr_factor, warmup_steps
from tests.conftest import TINY_YAML


def test_help_lists_every_key_with_type_default_and_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: scale-train") and "--accelerate-config" in out and "--num-processes" in out
    keys_part = out[out.index("config keys:"):]
    listed = {line.split()[0]: line for line in keys_part.splitlines() if line.startswith("  ")}
    assert list(listed) == [key for key, _, _ in schema_fields()]  # every key, data.datasets[i].* too, in order
    assert listed["optim.lr"].split() == ["optim.lr", "float", "=", "0.0002", "Peak", "learning", "rate", "(per",
                                          "optimizer", "step)."]
    assert "  train.max_steps " in out and "int | null = 100  Optimizer steps to run;" in listed["train.max_steps"]
    assert 'str = "Review: {text}\\nSentiment: {label}"  classification: prompt template' in listed["data.template"]
    assert max(len(line) for line in out.splitlines()) < 200  # one line per key


def test_help_section_key_and_trl_name(capsys):
    assert main(["--help", "optim"]) == 0
    out = capsys.readouterr().out
    keys = [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")]
    assert keys == [k for k in all_keys() if k.startswith("optim.")]
    assert "optim.warmup_ratio: float | null = null\n    Warmup length as a fraction" in out
    assert main(["--help", "train.keep_best"]) == 0
    assert capsys.readouterr().out.startswith("train.keep_best: str | null = null\n    Keep the checkpoint")
    assert main(["--help=learning_rate"]) == 0
    assert capsys.readouterr().out == "learning_rate (TRL/transformers, default 2e-05 (transformers: 5e-05)) -> optim.lr\n"
    assert main(["--help", "trl"]) == 0
    assert "per_device_train_batch_size    -> train.micro_batch_size" in capsys.readouterr().out


def test_help_of_an_unknown_topic_is_one_line_and_exit_2(capsys):
    assert main(["--help", "optm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scale-train: error: ConfigError: --help optm: no such section or key: did you mean optim")
    assert err.count("\n") == 1


@pytest.mark.parametrize("override, message", [
    ("train.max_stpes=5", "unknown config key train.max_stpes: did you mean train.max_steps?"),
    ("train.warmup_steps=5", "unknown config key train.warmup_steps: did you mean optim.warmup_steps?"),
    ("train.lr=1e-3", "unknown config key train.lr: did you mean optim.lr?"),
    ("data.eval_sise=8", "unknown config key data.eval_sise: did you mean data.eval_size or data.eval_split?"),
    ("seed=1", "unknown config key seed: did you mean train.seed?"),
    ("optim.learning_rate=1e-4", "unknown config key optim.learning_rate: TRL/transformers' learning_rate is optim.lr "
                                 "here (scale default 0.0002; TRL 2e-05 (transformers: 5e-05))"),
    ("per_device_train_batch_size=4", "unknown config key per_device_train_batch_size: TRL/transformers' "
                                      "per_device_train_batch_size is train.micro_batch_size here (scale default 8; "
                                      "TRL 8)"),
    ("train.num_train_epochs=1", "unknown config key train.num_train_epochs: TRL/transformers' num_train_epochs is "
                                 "train.num_epochs here (scale default None; TRL 3.0); whole epochs; set "
                                 "train.max_steps=null with it"),
    ("data.max_seq_length=512", "unknown config key data.max_seq_length: TRL/transformers' max_seq_length is "
                                "data.max_length here (scale default 128; TRL 1024 (TRL < 0.20)); as max_length"),
    ("neftune_noise_alpha=5", "unknown config key neftune_noise_alpha: TRL/transformers' neftune_noise_alpha has no "
                              "scale setting (not offered)"),
    ("nope.x=1", "unknown config key nope; known keys in the top level: ['data', 'eval', 'log', 'lora', 'loss', "
                 "'model', 'optim', 'output_dir', 'rl', 'train']; scale-train --help lists them"),
])
def test_unknown_keys_get_the_closest_keys_or_the_scale_key_of_a_trl_name(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY_YAML, [override])
    assert str(e.value) == message


def test_a_trl_config_file_names_every_unknown_key(tmp_path):
    path = tmp_path / "trl.yaml"
    path.write_text("learning_rate: 2.0e-5\nnum_train_epochs: 3\nbf16: true\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (
        f"{path}: 3 unknown config keys: learning_rate: TRL/transformers' learning_rate is optim.lr here (scale "
        f"default 0.0002; TRL 2e-05 (transformers: 5e-05)); num_train_epochs: TRL/transformers' num_train_epochs is "
        f"train.num_epochs here (scale default None; TRL 3.0); whole epochs; set train.max_steps=null with it; bf16: "
        f"TRL/transformers' bf16 is train.mixed_precision here (scale default 'auto'; TRL None (TRL: true unless "
        f"fp16)); bf16; auto measures first")


def test_a_config_file_with_unknown_keys_in_several_sections_names_the_file_and_each_key(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("data:\n  max_lenght: 512\ntrain:\n  learning_rate: 2.0e-5\n  max_steps: 5\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (f"{path}: 2 unknown config keys: data.max_lenght: did you mean data.max_length?; "
                            f"train.learning_rate: TRL/transformers' learning_rate is optim.lr here (scale default "
                            f"0.0002; TRL 2e-05 (transformers: 5e-05))")
    path.write_text("data:\n  max_lenght: 512\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: unknown config key data.max_lenght: did you mean data.max_length?"


@pytest.mark.parametrize("typo, hint", [("lr", "did you mean optim.lr?"), ("optim.lrr", "did you mean optim.lr?"),
                                        ("train.micro_batchsize",
                                         "did you mean train.micro_batch_size or train.eval_micro_batch_size?"),
                                        ("optm", "did you mean optim?"), ("trian", "did you mean train?")])
def test_help_and_overrides_suggest_the_same_key(capsys, typo, hint):
    """``--help TOPIC`` and an override of that key answer with one rule (scale.config.names.suggest): ``lr`` is
    optim.lr on both paths (the help suggested lora), ``optim.lrr`` optim.lr (the help suggested optim)."""
    assert main(["--help", typo]) == 2
    assert capsys.readouterr().err == (f"scale-train: error: ConfigError: --help {typo}: no such section or key: "
                                       f"{hint} (sections: data, eval, log, lora, loss, model, optim, rl, train; --help "
                                       f"trl lists TRL/transformers names)\n")
    if "." in typo or typo == "lr":
        with pytest.raises(ConfigError) as e:
            load_config(TINY_YAML, [f"{typo}=1"])
        assert str(e.value) == f"unknown config key {typo}: {hint}"


def test_every_trl_name_maps_to_keys_of_the_schema():
    keys = set(all_keys())
    assert all(set(n.keys) <= keys for n in TRL_NAMES), [n for n in TRL_NAMES if not set(n.keys) <= keys]
    names = {n.name for n in TRL_NAMES}
    # the common SFTConfig / TrainingArguments fields (TRL 1.16, transformers 5.24), each with a row
    assert names >= {"learning_rate", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
                     "warmup_ratio", "warmup_steps", "lr_scheduler_type", "max_length", "max_seq_length", "packing",
                     "completion_only_loss", "assistant_only_loss", "dataset_text_field", "weight_decay",
                     "max_grad_norm", "seed", "output_dir", "bf16", "gradient_checkpointing", "eval_steps",
                     "save_steps", "logging_steps", "save_total_limit"}


def test_a_trl_sft_config_of_12_fields_translates_with_the_table():
    """The acceptance exercise: 12 common SFTConfig fields, each rewritten with the table's scale key, load."""
    trl = {"output_dir": "runs/x", "learning_rate": 1e-4, "per_device_train_batch_size": 4,
           "gradient_accumulation_steps": 2, "warmup_ratio": 0.1, "lr_scheduler_type": "linear", "max_length": 256,
           "packing": True, "weight_decay": 0.01, "max_grad_norm": 0.5, "seed": 7, "logging_steps": 5}
    by_name = {n.name: n for n in TRL_NAMES}
    overrides = [f"{by_name[k].keys[0]}={str(v).lower() if isinstance(v, bool) else v}" for k, v in trl.items()]
    cfg = load_config(TINY_YAML, overrides + ["optim.min_lr_ratio=0"])
    assert (cfg.output_dir, cfg.optim.lr, cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps,
            cfg.optim.warmup_ratio, cfg.optim.schedule, cfg.data.max_length, cfg.data.packing, cfg.optim.weight_decay,
            cfg.optim.max_grad_norm, cfg.train.seed, cfg.train.log_every) == \
        ("runs/x", 1e-4, 4, 2, 0.1, "linear", 256, True, 0.01, 0.5, 7, 5)
    assert differences_from_trl(cfg, warmup_steps(cfg.optim, 100))[0].startswith("lr 0.0001: 10 warmup steps")
    tail = "a row trains only its tail"  # SFT only: TRL's DPOTrainer trains each side's completion too
    assert any(d.startswith(tail) for d in differences_from_trl(cfg, 0))
    dpo = load_config(TINY_YAML, ["loss.objective=dpo"])
    assert not any(d.startswith(tail) for d in differences_from_trl(dpo, 0))
    tokens = "a pair's tokens follow scale's conventions"  # pairs: TRL's trainers tokenize otherwise
    assert any(d.startswith(tokens) for d in differences_from_trl(dpo, 0))
    assert not any(d.startswith(tokens) for d in differences_from_trl(cfg, 0))
    assert not any(d.startswith(tokens) for d in differences_from_trl(
        load_config(TINY_YAML, ["loss.objective=dpo", "data.pair_conventions=trl"]), 0))


def test_suggestions_stay_quiet_when_nothing_is_close():
    assert suggest("zzz.qqq") == ""


def test_nested_sweep_parameter_merges_into_its_section():
    """``wandb agent`` passes a nested sweep parameter as ``--optim={'lr': 0.002}``: it sets optim.lr and keeps
    the config file's other optim keys (tiny_cpu: warmup_steps 2), instead of the schema's defaults (10)."""
    args = parse_args(["--config", str(TINY_YAML), "--optim={'lr': 0.002, 'max_grad_norm': None}",
                       "--train={'max_steps': 3}"])
    cfg = load_config(args.config, args.overrides)
    base = load_config(TINY_YAML)
    assert cfg.optim.lr == 0.002 and cfg.optim.max_grad_norm is None and cfg.train.max_steps == 3
    assert cfg.optim.warmup_steps == base.optim.warmup_steps == 2
    assert (cfg.optim.schedule, cfg.train.micro_batch_size, cfg.train.eval_every) == \
        (base.optim.schedule, base.train.micro_batch_size, base.train.eval_every)
    with pytest.raises(ConfigError, match=r"^unknown config key optim.lrr: did you mean optim.lr\?$"):
        load_config(TINY_YAML, ["optim={'lrr': 0.002}"])
    # a mapping-valued key (not a section) is still replaced whole
    assert load_config(TINY_YAML, ["data.chat_template_kwargs={a: 1}"]).data.chat_template_kwargs == {"a": 1}


def test_python_none_is_null_where_a_key_may_be_null():
    cfg = load_config(TINY_YAML, ["optim.max_grad_norm=None", "log.run_name=None"])
    assert cfg.optim.max_grad_norm is None and cfg.log.run_name is None
    with pytest.raises(ConfigError, match="train.micro_batch_size='None' must be a number >= 1 or 'auto'"):
        load_config(TINY_YAML, ["train.micro_batch_size=None"])


@pytest.mark.parametrize("ratio, steps, warmup", [(0.1, 100, 10), (0.1, 95, 10), (0.03, 100, 3), (0.0, 50, 0),
                                                  (1.0, 12, 12)])
def test_warmup_ratio_replaces_warmup_steps(ratio, steps, warmup):
    optim = load_config(TINY_YAML, [f"optim.warmup_ratio={ratio}", "optim.warmup_steps=4"]).optim
    assert warmup_steps(optim, steps) == warmup == math.ceil(ratio * steps)
    factors = [lr_factor(s, optim, steps) for s in range(steps)]
    if 1 < warmup < steps:
        assert factors[:warmup] == [(s + 1) / warmup for s in range(warmup)] and factors[warmup - 1] == 1.0
    assert factors[-1] == pytest.approx(optim.min_lr_ratio) or warmup >= steps - 1
    without = load_config(TINY_YAML, ["optim.warmup_steps=4"]).optim
    assert warmup_steps(without, steps) == 4


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_warmup_ratio_outside_0_1_is_refused(value):
    with pytest.raises(ConfigError, match=rf"^optim.warmup_ratio={float(value)} must lie in \[0, 1\]"):
        load_config(TINY_YAML, [f"optim.warmup_ratio={value}"])


def test_keys_help_of_one_key_wraps_its_whole_text():
    text = keys_help("data.max_length")
    assert text.splitlines()[0] == "data.max_length: int = 128"
    assert all(line.startswith("    ") and len(line) <= 100 for line in text.splitlines()[1:])


def test_show_rows_shows_the_rows_when_eval_size_does_not_fit(tmp_path, capsys):
    """One looks at the rows to choose data.eval_size: a value the data cannot hold (160 rows) no longer hides
    them; they are shown split with one held-out row, and the run's error follows as a note."""
    from tests.conftest import TINY_DATA

    code = main(["--config", str(TINY_YAML), f"data.path={TINY_DATA}", "data.eval_size=400", "--show-rows", "2",
                 f"output_dir={tmp_path / 'out'}", f"data.cache_dir={tmp_path / 'cache'}"])
    captured = capsys.readouterr()
    assert code == 0 and not (tmp_path / "out").exists()
    lines = captured.out.splitlines()
    assert lines[0] == "format=classification; trained tokens between [[ and ]]"
    assert lines[1].startswith("data: train_rows=159 eval_rows=1 ") and lines[2].startswith("--- data-file row ")
    assert captured.out.count("--- data-file row") == 2 and "Sentiment:[[" in captured.out
    assert captured.err == ("scale-train: note: rows shown with data.eval_size=1; a run would stop: data has 160 rows "
                            "but data.eval_size=400; lower data.eval_size\n")
    assert main(["--config", str(TINY_YAML), "data.path=nowhere.jsonl", "--show-rows", "2"]) == 2  # other errors stay


@pytest.mark.parametrize("module, first", [("cli", "scale-train: parse the command line"), ("plan", None),
                                           ("generate", None), ("export", None), ("report", None),
                                           ("prepare", None), ("lmeval", None)])
def test_every_command_help_reads_as_plain_text(module, first, capsys):
    """Each command's --help prints its module docstring without reST markup (double backquotes, :data: roles)."""
    import importlib

    from scale.config.help import help_text

    mod = importlib.import_module(f"scale.{module}")
    try:
        code = mod.main(["--help"])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr().out
    assert code in (0, None) and out.startswith("usage: ")
    assert "``" not in out and not re.search(r":(data|func|class|attr|meth|mod|obj|exc):`", out)
    assert " ".join(help_text(mod.__doc__).split("\n")[0].split()) in " ".join(out.split())
    if first is not None:
        assert first in out
    assert help_text("2 (:data:`EXIT_BAD_INPUT`) and ``x`` via :func:`~scale.a.b`") == "2 (EXIT_BAD_INPUT) and x via scale.a.b"
