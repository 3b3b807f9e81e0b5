"""What trains: ``model.finetune: lora | full`` (and LLaMA-Factory's ``finetuning_type``), the refusals of keys that
do not fit full weights, the ``lora.*`` warning, and :class:`scale.modeling.finetune.WeightsPlan` per launch mode."""

from __future__ import annotations

import pytest
import torch

from scale.config.load import load_config
from scale.config.validation import ConfigError
from scale.modeling.build import build_model, parameter_counts
from scale.modeling.finetune import ignored_lora_line, weights_plan
from tests.conftest import TINY_YAML, tiny_cfg


def test_full_trains_every_weight_in_float32(tmp_path):
    cfg = tiny_cfg(tmp_path, "model.finetune=full")
    model = build_model(cfg.model, cfg.lora, 49152, cfg.train.seed)
    assert not hasattr(model, "peft_config")  # the transformers model itself, no adapter
    params = list(model.named_parameters())
    assert all(p.requires_grad for _, p in params), [n for n, p in params if not p.requires_grad][:3]
    assert {p.dtype for _, p in params} == {torch.float32}
    trainable, total = parameter_counts(model)
    assert trainable == total == sum(p.numel() for _, p in params)
    assert model.training and model.is_gradient_checkpointing
    # the same seed builds the same base weights as a LoRA run's base
    lora = build_model(tiny_cfg(tmp_path).model, cfg.lora, 49152, cfg.train.seed)
    base = {n.replace(".base_layer", ""): p for n, p in lora.get_base_model().named_parameters() if "lora_" not in n}
    assert base.keys() == dict(params).keys() and all(torch.equal(p, base[n]) for n, p in params)
    lora_trainable, lora_total = parameter_counts(lora)
    assert lora_trainable < lora_total and lora_total - lora_trainable == total


def test_finetuning_type_is_read_as_finetune(tmp_path):
    assert load_config(TINY_YAML, ["model.finetuning_type=full"]).model.finetune == "full"
    yaml = tmp_path / "c.yaml"
    yaml.write_text(TINY_YAML.read_text() + "\n", encoding="utf-8")
    text = yaml.read_text().replace("model:\n", "model:\n  finetuning_type: full\n", 1)
    yaml.write_text(text, encoding="utf-8")
    assert load_config(yaml).model.finetune == "full"
    assert load_config(yaml, ["model.finetune=lora"]).model.finetune == "lora"  # an override of the key wins
    yaml.write_text(text.replace("model:\n", "model:\n  finetune: lora\n", 1), encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(yaml)
    assert str(e.value) == ("model.finetuning_type='full' and model.finetune='lora' disagree (model.finetuning_type "
                            "is another name for model.finetune); set only model.finetune")
    with pytest.raises(ConfigError, match=r"model.finetune='partial' is not one of \['lora', 'full'\]"):
        load_config(TINY_YAML, ["model.finetune=partial"])


@pytest.mark.parametrize("overrides, message", [
    (["model.quantize_4bit=true"], "model.finetune=full with model.quantize_4bit=true: QLoRA trains an adapter over a "
     "frozen 4-bit base, 4-bit weights cannot be trained; set model.quantize_4bit=false or model.finetune=lora"),
    (["model.adapter=runs/sft/adapter"], "model.finetune=full with model.adapter=runs/sft/adapter: a full run starts "
     "from a model directory; merge the adapter (scale-export RUN) and set model.name_or_path=RUN/merged, "
     "model.adapter=null"),
    (["model.dtype=bfloat16"], "model.finetune=full with model.dtype=bfloat16: the optimizer would step bfloat16 "
     "weights (updates below |w|/256 vanish in bfloat16); set model.dtype=float32 (the fp32 masters) and "
     "train.mixed_precision=bf16 for bf16 compute"),
    (["train.mixed_precision=fp16"], "model.finetune=full with train.mixed_precision=fp16: the loss scaler's state is "
     "not kept for full weights; set train.mixed_precision=bf16 (or no)"),
])
def test_full_refuses_what_does_not_fit(tmp_path, capsys, overrides, message):
    from scale.cli import main

    args = ["--config", str(TINY_YAML), f"output_dir={tmp_path / 'out'}", "model.finetune=full", *overrides]
    assert main(args) == 2
    assert capsys.readouterr().err == f"scale-train: error: ConfigError: {message}\n"
    assert not (tmp_path / "out").exists()
    # the same keys without model.finetune=full are accepted by the config reader
    without = [o for o in overrides if not o.startswith(("model.adapter", "train.mixed_precision=fp16"))]
    load_config(TINY_YAML, without)


def test_dpo_reference_of_full_weights_is_the_frozen_copy(tmp_path):
    """Under model.finetune=full, DPO's default reference (adapter: there is no adapter to switch off) resolves to
    model in place, as TRL's DPOTrainer copies the model given no ref_model and no peft_config; an explicit
    precomputed stays; a LoRA run keeps the adapter, and loss.reference=model there is one line naming the fix."""
    from scale.config.load import to_dict

    dpo = ["loss.objective=dpo", "data.format=preference"]
    cfg = load_config(TINY_YAML, ["model.finetune=full", *dpo])
    assert cfg.loss.reference == "model" and to_dict(cfg)["loss"]["reference"] == "model"  # what config.yaml records
    assert load_config(TINY_YAML, ["model.finetune=full", *dpo, "loss.reference=precomputed"]).loss.reference == \
        "precomputed"
    assert load_config(TINY_YAML, dpo).loss.reference == "adapter"
    assert load_config(TINY_YAML, ["model.finetune=full"]).loss.reference == "adapter"  # sft reads none
    with pytest.raises(ConfigError) as e:
        load_config(TINY_YAML, [*dpo, "loss.reference=model"])
    assert str(e.value) == ("loss.reference=model with model.finetune=lora: the reference is the base itself with the "
                            "LoRA adapter switched off (no second copy of the weights); set loss.reference=adapter "
                            "(or precomputed)")


def test_lora_keys_under_full_are_one_warning_line(tmp_path):
    assert ignored_lora_line(tiny_cfg(tmp_path)) is None  # a LoRA run reads them
    assert ignored_lora_line(tiny_cfg(tmp_path, "model.finetune=full")) == (
        "ignored: lora.r=8, lora.alpha=16.0, lora.dropout=0.0: model.finetune=full trains every weight and no LoRA "
        "adapter")  # tiny_cpu.yaml's lora.* keys, set away from the defaults
    assert ignored_lora_line(tiny_cfg(tmp_path, "model.finetune=full", "lora.r=16", "lora.alpha=32",
                                      "lora.dropout=0.05")) is None  # the defaults: nothing was asked of LoRA


@pytest.mark.parametrize("mode, precision, module, separate", [
    ("single", "no", "float32", False), ("ddp", "bf16", "float32", False), ("fsdp", "bf16", "float32", False),
    ("zero1", "no", "float32", False), ("zero2", "bf16", "bfloat16", True), ("zero3", "bf16", "bfloat16", True),
])
def test_weights_plan_keeps_fp32_masters_in_every_mode(tmp_path, mode, precision, module, separate):
    plan = weights_plan(tiny_cfg(tmp_path, "model.finetune=full", f"train.mixed_precision={precision}"), mode)
    assert (plan.trains, plan.module_dtype, plan.master_dtype, plan.separate_master, plan.grad_accum_dtype,
            plan.optimizer_state_dtype) == ("full", module, "float32", separate, "float32", "float32")
    assert len(plan.notes) == 1 and "fp32 gradient accumulation, fp32 adamw state" in plan.notes[0]
    lora = weights_plan(tiny_cfg(tmp_path, f"train.mixed_precision={precision}"), mode)
    assert (lora.trains, lora.grad_accum_dtype, lora.notes) == ("lora", module, ())  # as LoRA always ran


def test_deepspeed_accumulates_full_weight_gradients_in_fp32(tmp_path):
    from scale.distributed.launch import LaunchError, reconcile_deepspeed

    full = tiny_cfg(tmp_path, "model.finetune=full", "train.mixed_precision=bf16")
    ds = {"bf16": {"enabled": "auto"}}
    reconcile_deepspeed(full, ds)
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    ds = {"data_types": {"grad_accum_dtype": "fp32"}}
    reconcile_deepspeed(full, ds)  # said already: kept
    with pytest.raises(LaunchError) as e:
        reconcile_deepspeed(full, {"data_types": {"grad_accum_dtype": "bf16"}})
    assert str(e.value) == ("the DeepSpeed config sets data_types.grad_accum_dtype=bf16 and the run has "
                            "model.finetune=full with train.mixed_precision=bf16: full weights accumulate gradients "
                            "in fp32; set it to \"fp32\" or remove it from the JSON")
    for cfg in (tiny_cfg(tmp_path, "train.mixed_precision=bf16"), tiny_cfg(tmp_path, "model.finetune=full")):
        ds = {}
        reconcile_deepspeed(cfg, ds)  # LoRA, and fp32 full weights: DeepSpeed's default, as before
        assert "data_types" not in ds


def test_start_up_check_reads_the_real_optimizer(tmp_path):
    """The check passes on what a full run builds (one device: the fp32 parameters are the masters) and fails,
    naming the mode, when the optimizer would step bf16 weights."""
    from scale.distributed.launch import LaunchError
    from scale.training.precision import check_full_precision

    cfg = tiny_cfg(tmp_path, "model.finetune=full", "train.mixed_precision=bf16")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    line = check_full_precision(cfg, "ddp", model, torch.optim.AdamW(model.parameters()))
    assert line == ("precision: full weights under ddp: forward weights float32, the optimizer steps 4 float32 "
                    "tensor(s) of 23 elements on this rank (the masters), gradients accumulate in float32, adamw "
                    "state float32")
    assert check_full_precision(tiny_cfg(tmp_path), "ddp", model, None) is None  # LoRA: nothing to check
    model.to(torch.bfloat16)
    with pytest.raises(LaunchError) as e:
        check_full_precision(cfg, "ddp", model, torch.optim.AdamW(model.parameters()))
    assert str(e.value) == ("model.finetune=full under ddp: optimizer steps bfloat16 (expected float32); gradients "
                            "accumulate in bfloat16 (expected float32); forward weights bfloat16 (expected float32): "
                            "this library version changed what the mode does with full weights; report it with "
                            "scale-env's output")
