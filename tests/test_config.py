"""Config schema: every shipped YAML loads; overrides, types and errors name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from scale.config.help import help_table
from scale.config.load import dump_config, load_config
from scale.config.validation import ConfigError
from tests.conftest import ROOT


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "train").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_training_yaml_loads(path):
    cfg = load_config(path)
    assert (cfg.train.max_steps or cfg.train.num_epochs) >= 1


def test_overrides_and_round_trip(tmp_path):
    cfg = load_config(None, ["train.max_steps=7", "optim.lr=3e-4", "lora.target_modules=[q_proj,v_proj]",
                             "output_dir=x", "data.type_column=kind"])
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 3e-4 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.output_dir == "x" and cfg.data.type_column == "kind"
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize("override, message", [
    ("train.max_steps=ten", r"train.max_steps='ten' has the wrong type: expected int"),
    ("train.max_steps=1.5", r"train.max_steps=1.5 has the wrong type: expected int"),
    ("model.quantize_4bit=maybe", r"model.quantize_4bit='maybe' has the wrong type: expected bool"),
    ("nope.x=1", r"unknown config key nope; known keys in the top level"),
    ("train.micro_batch_size=0", r"train.micro_batch_size=0 must be >= 1"),
    ("data.padding_side=middle", r"data.padding_side='middle' is not one of \['left', 'right'\]"),
    ("loss.target_position=-3", r"loss.target_position=-3 is outside the tail: it must be between -2 and -1"),
    ("train.max_steps", r"override 'train.max_steps' must look like section.key=value"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_config_reference_matches_schema():
    from scale.config.help import config_doc

    doc = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert doc == config_doc(), "docs/config.md is stale: python -m scale.config.help > docs/config.md"
    assert help_table() in doc and "| `learning_rate` | 2e-05 (transformers: 5e-05) | `optim.lr` | `0.0002` |" in doc


def test_default_is_default_yaml():
    assert load_config(None) == load_config(Path(ROOT / "configs/train/default.yaml"))
