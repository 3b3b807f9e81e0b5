"""LoRA and QLoRA with gradient checkpointing in every launch mode; export. (That a ZeRO-3 adapter is whole and
reproduces the run's evaluation is asserted on tests/test_distributed.py's ZeRO-3 parity run.)

Each launched job runs 1 optimizer step with ``train.check_invariants=true``, which writes to metrics.jsonl
whether the base weights stayed bit-identical, the LoRA weights agree on every rank and every lora_B moved.
LoRA in the modes tests/test_distributed.py runs for parity (single 1x(8,1), ddp, zero2, zero3: the tiny job
checkpoints, with the same invariants checked after 6 steps) is not launched again here, nor QLoRA on one device
(tests/test_qlora.py checks the same invariants on its in-process run) or under ZeRO-3 (tests/test_zero3_directory.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.launching import assert_invariants, modes, run_mode
from tests.conftest import tiny_cfg

HAS_DS = importlib.util.find_spec("deepspeed") is not None
MODES = ["single 1x(8,1)", "ddp 2x(2,2)"] + (["zero1 2x(2,2)", "zero2 2x(2,2)", "zero3 2x(2,2)"] if HAS_DS else [])
# LoRA checked in test_distributed.py (its ZeRO-3 row loads the model from a save_pretrained directory)
PARITY = ("single 1x(8,1)", "ddp 2x(2,2)", "zero2 2x(2,2)", "zero3 2x(2,2)")
# Checkpointed QLoRA with these invariants on one device: tests/test_qlora.py (in process, the default uint8 storage);
# under ZeRO-3 with a float quant storage: tests/test_zero3_directory.py (bf16, SmolLM2 shapes, from a directory).
QLORA_ELSEWHERE = {("qlora", "single 1x(8,1)"), ("qlora", "zero3 2x(2,2)")}
QLORA = ["model.quantize_4bit=true", "model.bnb_4bit_compute_dtype=float32", "model.bnb_4bit_quant_storage=float32"]


@pytest.mark.launch
@pytest.mark.parametrize("mode,kind", [(m, k) for m in MODES for k in ("lora", "qlora")
                                       if (k == "qlora" or m not in PARITY) and (k, m) not in QLORA_ELSEWHERE])
def test_checkpointed_lora_and_qlora_in_every_mode(mode, kind, tmp_path):
    cmds, overrides = modes()[mode]
    extra = ["train.max_steps=1", "model.gradient_checkpointing=true", "train.check_invariants=true",
             *(QLORA if kind == "qlora" else [])]
    assert_invariants(run_mode(cmds, overrides + extra, tmp_path)["checks"], mode, step=1)


def test_checkpointing_on_equals_off_gradients():
    from scale.config.schema import LoraConfig, ModelConfig
    from scale.modeling.build import build_model

    ids = torch.randint(3, 300, (4, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for gc_on in (False, True):
        model = build_model(ModelConfig(name_or_path="tiny-llama", gradient_checkpointing=gc_on),
                            LoraConfig(r=4, alpha=8.0, dropout=0.0), vocab_size=300, seed=0)
        with torch.no_grad():   # make lora_B non-zero so every LoRA tensor gets a gradient
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=2).logits
        out.float().pow(2).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    off, on = grads
    assert len(off) == 28 and all(off[n].abs().max() > 0 for n in off)
    max_abs = max((off[n] - on[n]).abs().max().item() for n in off)
    assert max_abs == 0.0   # non-reentrant checkpointing in fp32 recomputes bit-identically


def test_merged_export_predicts_like_adapter_plus_base(tmp_path, tokenizer):
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from scale.config.load import load_config
    from scale.data import Collator, build_splits
    from scale.generation.export import merge_run
    from scale.loss import tail as scale_loss
    from scale.modeling.build import load_base
    from scale.train import run

    run(tiny_cfg(tmp_path, "model.quantize_4bit=true", "train.max_steps=4", "optim.lr=5e-3"))
    merged_dir = merge_run(tmp_path)
    cfg = load_config(tmp_path / "config.yaml")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert merged.config.use_cache is True and not hasattr(merged.config, "quantization_config")
    adapted = PeftModel.from_pretrained(load_base(cfg.model, len(tokenizer), cfg.train.seed), tmp_path / "adapter").eval()
    splits = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    batch = Collator(tokenizer.pad_token_id, "left")(splits.eval)
    labels = torch.tensor(splits.label_token_ids)
    with torch.no_grad():
        preds = []
        for m in (adapted, merged):
            tail, _ = scale_loss.forward_tail(m, batch, cfg.loss.threshold)
            preds.append(tail[:, cfg.loss.threshold + cfg.loss.target_position][:, labels].argmax(-1))
            if m is adapted:
                ref_logits = tail
            else:
                max_diff = (tail - ref_logits).abs().max().item()
    assert torch.equal(preds[0], preds[1]) and len(preds[0]) == 32
    assert max_diff < 1e-3
