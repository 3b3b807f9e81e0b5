"""The objectives room (scale.objectives): ``loss.objective`` picks one objective behind one interface, and the
``sft`` objective's micro-batch numerator is exactly the tail loss it replaces (the same operations, compared with
``torch.equal``)."""

from __future__ import annotations

import pytest
import torch

from scale.config.load import load_config, to_dict
from scale.config.schema import LoraConfig, ModelConfig
from scale.config.validation import ConfigError
from scale.data import Collator, Example
from scale.loss import tail as scale_loss
from scale.modeling.build import build_model
from scale.objectives import OBJECTIVES, build_objective
from scale.objectives.base import Objective
from scale.objectives.tail import LossSpec
from scale.training.checkpoint import compare_configs
from tests.conftest import TINY_YAML

V = 300


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    rows = [Example(torch.randint(3, V, (n,), generator=g).tolist(), t, i % 2, 7, row=i)
            for i, (n, t) in enumerate(zip((12, 7, 15), (4, 2, 9)))]
    return Collator(0, "left")(rows)


def test_sft_is_the_default_and_meets_the_interface():
    cfg = load_config(TINY_YAML)
    objective = build_objective(cfg)
    assert cfg.loss.objective == "sft" and objective.name == "sft"
    assert set(OBJECTIVES) == {"sft", "dpo", "simpo", "orpo", "grpo"}
    assert isinstance(objective, Objective) and isinstance(objective, LossSpec)
    assert objective == LossSpec.from_config(cfg)
    batch = _batch()
    assert set(objective.batch_keys) <= set(batch)
    w = objective.weights(batch)
    assert w.shape == batch["tail_mask"].shape and torch.equal(w, batch["tail_mask"].float())  # no type weights


def test_sft_loss_step_is_the_tail_loss_numerator():
    """loss_step (unchunked at this size: 3 x 9 positions x 300 vocab is far under the 256 MiB threshold) is the
    numerator of scale.loss.tail.tail_loss on the tail logits: the same operations, so equal bit for bit."""
    model = build_model(ModelConfig(name_or_path="tiny-llama", gradient_checkpointing=False),
                        LoraConfig(r=4, dropout=0.0), vocab_size=V, seed=0).eval()
    objective = build_objective(load_config(TINY_YAML, ["loss.type_weights=[1.0,0.5]"]))
    batch = _batch()
    w = objective.weights(batch)
    assert torch.equal(w, batch["tail_mask"].float() * torch.tensor([[1.0], [0.5], [1.0]]))
    with torch.no_grad():
        got = objective.loss_step(model, batch, w)
        logits, targets = scale_loss.forward_tail(model, batch, padding_side="left", check=False)
        want, den = scale_loss.tail_loss(logits, targets, w, batch["type_indicator"])
    assert got.shape == () and torch.equal(got, want) and float(den) == float(w.sum())


def test_an_unknown_objective_is_one_config_error():
    with pytest.raises(ConfigError,
                       match=r"^loss\.objective='kto' is not one of \['sft', 'dpo', 'simpo', 'orpo', 'grpo'\]$"):
        load_config(TINY_YAML, ["loss.objective=kto"])


def test_a_checkpoint_written_before_loss_objective_resumes():
    """A checkpoint's config without ``loss.objective`` (written before the key existed) trained sft."""
    cfg = load_config(TINY_YAML)
    saved = to_dict(cfg, redacted=False)
    del saved["loss"]["objective"]
    assert compare_configs(saved, to_dict(cfg, redacted=False)) == ([], [])
