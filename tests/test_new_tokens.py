"""Tokens added to the tokenizer (``model.new_tokens``/``new_special_tokens``) and ``lora.modules_to_save``: the
embeddings grow as transformers' ``resize_token_embeddings`` grows them, the new rows train (beside a LoRA adapter,
or with every weight), the checkpoint resumes bit-exactly, and the saved adapter / model directory loads back by
plain peft / transformers (the base grown to the saved tokenizer's length first) and evaluates as the run did."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors.torch import load_file

from scale.config.validation import ConfigError
from scale.train import run
from scale.training.metrics import read_jsonl
from tests.bounds import TINY_JOB_REL
from tests.conftest import reset_accelerate, tiny_cfg

NEW = ["<|review|>", "<|sentiment|>"]
# the new tokens in every row, so their input rows get gradient too (the head's rows get it from every softmax)
TOKENS = [f"model.new_special_tokens=[{', '.join(NEW)}]", "data.template=<|review|> {text}\n<|sentiment|> {label}"]
# 4 steps, a checkpoint at 2 and 4, evaluated at the end; the base is an untied tiny Llama directory
JOB = [*TOKENS, "lora.modules_to_save=[embed_tokens, lm_head]", "train.max_steps=4", "train.save_every=2",
       "train.eval_every=4", "train.log_every=1", "eval.generate_samples=0", "model.gradient_checkpointing=false"]


def _peft_ties() -> bool:
    from peft import LoraConfig

    return "ensure_weight_tying" in inspect.signature(LoraConfig).parameters


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama with an untied head, SmolLM2's tokenizer (49,152 tokens, as many rows), as a model directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from scale.config.schema import ModelConfig
    from scale.modeling.build import load_tokenizer

    out = tmp_path_factory.mktemp("base")
    tok = load_tokenizer(ModelConfig(name_or_path="tiny-llama"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         tie_word_embeddings=False, use_cache=False))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base_dir):
    out = tmp_path_factory.mktemp("lora_tokens")
    run(tiny_cfg(out, f"model.name_or_path={base_dir}", *JOB, "train.check_invariants=true"))
    reset_accelerate()
    return out


def _evaluate(run_dir, model):
    """The run's evaluation of ``model`` on its own eval split (tokenized as the run did)."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from scale.config.load import load_config
    from scale.data import Collator, build_splits
    from scale.modeling.build import load_tokenizer
    from scale.objectives.tail import LossSpec
    from scale.training.evaluate import evaluate

    cfg = load_config(run_dir / "config.yaml")
    tokenizer = load_tokenizer(cfg.model)
    splits = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    dl = DataLoader(splits.eval, batch_size=16, collate_fn=Collator(tokenizer.pad_token_id, "left"))
    return evaluate(Accelerator(cpu=True), model.eval(), dl, LossSpec.from_config(cfg))


def _as_the_run(run_dir, again):
    final = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/loss" in r][-1]
    assert again["eval/accuracy"] == final["eval/accuracy"]
    assert abs(again["eval/loss"] / final["eval/loss"] - 1) <= TINY_JOB_REL, (again, final)


def test_config_refuses_new_tokens_lora_would_not_train(tmp_path):
    with pytest.raises(ConfigError, match=r"model.new_special_tokens=\['<\|review\|>', '<\|sentiment\|>'\] with "
                                          r"model.finetune=lora and no lora.modules_to_save: .* set "
                                          r"lora.modules_to_save=\[embed_tokens, lm_head\]"):
        tiny_cfg(tmp_path, *TOKENS)
    with pytest.raises(ConfigError, match=r"model.new_tokens=\['a', 'a'\]: every entry must be a non-empty string"):
        tiny_cfg(tmp_path, "model.new_tokens=[a, a]", "model.finetune=full")
    assert tiny_cfg(tmp_path, *TOKENS, "model.finetune=full").model.new_special_tokens == NEW


def test_a_checkpoint_written_before_the_keys_compares_as_without_tokens(tmp_path):
    from scale.config.load import to_dict
    from scale.training.checkpoint import compare_configs

    current = to_dict(tiny_cfg(tmp_path), redacted=False)
    saved = to_dict(tiny_cfg(tmp_path))
    del saved["model"]["new_tokens"], saved["model"]["new_special_tokens"], saved["lora"]["modules_to_save"]
    assert compare_configs(saved, current) == ([], [])
    assert compare_configs(saved, to_dict(tiny_cfg(tmp_path, "model.new_tokens=[x]", "model.finetune=full"),
                                          redacted=False))[0][0].startswith("model.finetune")


def test_build_refuses_rows_lora_leaves_untrained(base_dir, tmp_path):
    """An untied head's new rows need it in lora.modules_to_save too; a tokenizer longer than the embeddings (no
    model.new_tokens) grows them just the same and is refused without them; an unknown module is named."""
    from scale.modeling.build import build_model, load_tokenizer

    cfg = tiny_cfg(tmp_path, f"model.name_or_path={base_dir}", *TOKENS, "lora.modules_to_save=[embed_tokens]")
    with pytest.raises(ConfigError, match=r"model.new_special_tokens=.*: the embeddings grew from 49152 rows and LoRA "
                                          r"leaves the new rows untrained; set "
                                          r"lora.modules_to_save=\['embed_tokens', 'lm_head'\] or model.finetune=full"):
        build_model(cfg.model, cfg.lora, len(load_tokenizer(cfg.model)), 0)
    longer = tmp_path / "tok"
    tok = load_tokenizer(cfg.model)
    tok.save_pretrained(longer)
    plain = tiny_cfg(tmp_path, f"model.name_or_path={base_dir}", f"model.tokenizer={longer}")
    with pytest.raises(ConfigError, match=r"the tokenizer's length: the embeddings grew from 49152 rows"):
        build_model(plain.model, plain.lora, len(load_tokenizer(plain.model)), 0)
    wrong = tiny_cfg(tmp_path, f"model.name_or_path={base_dir}", "lora.modules_to_save=[embeddings]")
    with pytest.raises(ConfigError, match=r"lora.modules_to_save: \['embeddings'\] name no module of this "
                                          r"LlamaForCausalLM"):
        build_model(wrong.model, wrong.lora, len(load_tokenizer(wrong.model)), 0)


def test_a_tied_head_stays_tied_or_is_refused_on_old_peft(tmp_path):
    """SmolLM2 and the tiny Llama tie the head to the embeddings: peft >= 0.18 (ensure_weight_tying) trains one copy
    the two share, grown to the tokenizer's length, whose new rows get gradient; older peft would train two untied
    copies, and is refused in one line naming the version."""
    from scale.modeling.build import build_model, load_tokenizer

    cfg = tiny_cfg(tmp_path, *TOKENS, "lora.modules_to_save=[embed_tokens]")
    rows = len(load_tokenizer(cfg.model))
    assert rows == 49152 + len(NEW)
    if not _peft_ties():
        with pytest.raises(ConfigError, match=r"lora.modules_to_save=\['embed_tokens'\] on a model whose head is tied "
                                              r"to its embeddings needs peft >= 0.18.0"):
            build_model(cfg.model, cfg.lora, rows, 0)
        return
    model = build_model(cfg.model, cfg.lora, rows, 0)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    (name, copy), = trained.items()
    assert name.endswith("embed_tokens.modules_to_save.default.weight") and copy.shape == (rows, 64)
    assert model.get_output_embeddings().modules_to_save["default"].weight is copy
    ids = torch.tensor([[1, 49152, 5, 49153, 7]])
    model(input_ids=ids, labels=ids).loss.backward()
    assert (copy.grad[49152:].abs().sum(dim=1) > 0).all()


def test_new_rows_train_and_only_the_adapter_and_saved_modules_change(lora_run, base_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scale.modeling.tokens import grow_embeddings

    losses = [r["train/loss"] for r in read_jsonl(lora_run / "metrics.jsonl") if "train/loss" in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    checks = next(r for r in read_jsonl(lora_run / "metrics.jsonl") if "check/base_unchanged" in r)
    assert checks["check/base_unchanged"] and checks["check/lora_B_nonzero"]
    adapter = lora_run / "adapter"
    assert len(AutoTokenizer.from_pretrained(adapter)) == 49152 + len(NEW)
    saved = load_file(adapter / "adapter_model.safetensors")
    assert {k for k in saved if "lora_" not in k} == {"base_model.model.model.embed_tokens.weight",
                                                      "base_model.model.lm_head.weight"}
    start = AutoModelForCausalLM.from_pretrained(base_dir)
    grow_embeddings(start, 49152 + len(NEW), 0)  # the run's starting rows: the same seed draws the same rows
    for key, before in (("base_model.model.model.embed_tokens.weight", start.get_input_embeddings().weight),
                        ("base_model.model.lm_head.weight", start.get_output_embeddings().weight)):
        assert saved[key].shape == (49152 + len(NEW), 64)
        assert (saved[key][49152:] != before[49152:]).any(dim=1).all(), key  # every new row moved


def test_lora_with_new_tokens_resumes_bit_exact(lora_run, base_dir, tmp_path):
    run(tiny_cfg(tmp_path, f"model.name_or_path={base_dir}", *JOB,
                 f"train.resume_from={lora_run}/checkpoints/step_000002"))
    ref, got = load_file(lora_run / "adapter" / "adapter_model.safetensors"), load_file(
        tmp_path / "adapter" / "adapter_model.safetensors")
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    losses = lambda d: {r["step"]: r["train/loss"] for r in read_jsonl(d / "metrics.jsonl") if "train/loss" in r}
    ref_losses, got_losses = losses(lora_run), losses(tmp_path)
    assert sorted(got_losses) == [3, 4] and all(got_losses[s] == ref_losses[s] for s in got_losses)


def test_plain_peft_loads_the_adapter_and_evaluates_as_the_run(lora_run, base_dir):
    """Plain transformers + peft, as docs/full.md says: the base grown to the saved tokenizer's length, then
    ``PeftModel.from_pretrained`` of the adapter (and of the last checkpoint, also a peft adapter directory)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for adapter in (lora_run / "adapter", lora_run / "checkpoints" / "step_000004"):
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        base.resize_token_embeddings(len(AutoTokenizer.from_pretrained(lora_run / "adapter")))
        _as_the_run(lora_run, _evaluate(lora_run, PeftModel.from_pretrained(base, adapter)))


def test_generate_and_export_grow_the_base(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scale.generation.export import merge_run
    from scale.generation.generator import load_for_generation

    model, tokenizer, _ = load_for_generation(lora_run)  # scale-generate RUN
    assert len(tokenizer) == 49152 + len(NEW) and "<|review|>" in tokenizer.get_vocab()
    _as_the_run(lora_run, _evaluate(lora_run, model))
    merged = merge_run(lora_run, tmp_path / "merged")  # scale-export RUN
    assert json.loads((merged / "config.json").read_text())["vocab_size"] == 49152 + len(NEW)
    assert len(AutoTokenizer.from_pretrained(merged)) == 49152 + len(NEW)
    _as_the_run(lora_run, _evaluate(lora_run, AutoModelForCausalLM.from_pretrained(merged)))


def test_full_finetune_with_new_tokens_saves_a_model_transformers_reloads(base_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run(tiny_cfg(tmp_path, f"model.name_or_path={base_dir}", *TOKENS, "model.finetune=full", "train.max_steps=2",
                 "train.eval_every=2", "eval.generate_samples=0", "model.gradient_checkpointing=false"))
    model_dir = tmp_path / "model"
    assert len(AutoTokenizer.from_pretrained(model_dir)) == 49152 + len(NEW)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.get_input_embeddings().weight.shape == (49152 + len(NEW), 64)
    _as_the_run(tmp_path, _evaluate(tmp_path, model))
