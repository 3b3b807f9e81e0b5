"""ZeRO-3 from a model directory (issue 21, item 1): ``from_pretrained`` under DeepSpeed's ``zero.Init`` is a
collective, so every rank loads the model at once (:func:`scale.training.parts.model.build_model_on_every_rank`);
before, rank 0 loaded it alone inside ``main_process_first`` and gloo aborted with a collective mismatch.

Two CPU processes (gloo) through the real ``accelerate launch`` with configs/accelerate/cpu_zero3.yaml. That LoRA in
fp32 from a ``save_pretrained`` directory gives one device's numbers is tests/test_distributed.py's ZeRO-3 parity row.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from scale.training.metrics import read_jsonl
from tests.launching import from_directory, modes, run_mode

pytestmark = [pytest.mark.launch,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")]

# SmolLM2-135M's geometry (hidden 576, 9 query / 3 key-value heads, MLP 1536, tied 49152-token embedding) with 2 of
# its 30 layers: the shapes ZeRO-3 partitions are the real model's, the run stays seconds long.
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
                     rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def test_zero3_qlora_bf16_from_a_smollm2_shaped_directory(tmp_path):
    """QLoRA (bf16 compute and storage, so ZeRO-3 shards the 4-bit weights) from a SmolLM2-shaped directory."""
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_SHAPE)).save_pretrained(tmp_path / "model")
    cmds, overrides = modes()["zero3 2x(2,2)"]
    qlora = ["model.quantize_4bit=true", "model.bnb_4bit_compute_dtype=bfloat16", "model.bnb_4bit_quant_storage=bfloat16",
             "model.dtype=bfloat16", "train.max_steps=2", "train.check_invariants=true", "data.max_length=48",
             # bf16 has no vector kernel on an AVX2 CPU: 8 eval rows and 1 generated sample of at most 4 tokens (QLoRA
             # generation under ZeRO-3, lock-step over the partitioned 4-bit model) instead of 32 and 4 of 128
             "eval.generate_samples=1", "eval.max_new_tokens=4", "data.eval_size=8"]
    res = run_mode(cmds, overrides + from_directory(tmp_path / "model") + qlora, tmp_path / "run")
    assert len(res["loss"]) == 2 and all(torch.isfinite(torch.tensor(res["loss"])))
    assert [(step, row) for step, row, _ in res["samples"]] == [(0, res["samples"][0][1]), (2, res["samples"][0][1])]
    assert len(res["weights"]) == 28 and all(t.numel() > 0 for t in res["weights"].values())  # gathered, not shards
    assert {t.shape for k, t in res["weights"].items() if "q_proj.lora_A" in k} == {torch.Size([8, 576])}
    checks = next(r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "check/base_unchanged" in r)
    assert checks["check/base_unchanged"] and checks["check/lora_B_nonzero"] and checks["check/lora_B_tensors"] == 14
    assert 0.45 < checks["check/param_elements_local_fraction"] < 0.55
