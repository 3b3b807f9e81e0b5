"""scale.utils.flops: the FLOPs-per-token formula against a hand count, parameter counts against a real model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scale.utils.flops import PEAK_BF16_FLOPS, flops_per_token, lora_params, mfu, param_counts, peak_flops

# hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 1000.
TINY = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000)
# Per layer: q 64*64 + k,v 2*64*32 + o 64*64 + MLP 3*64*128 = 4096 + 4096 + 4096 + 24576 = 36864.
N_LAYERS, N_HEAD = 2 * 36864, 1000 * 64
# Attention, T = 32: 12 * layers * T * (heads * head_dim) = 12 * 2 * 32 * 64.
ATTN = 49152
# LoRA r=8 on q,k,v,o,gate,up,down: 8 * ((64+64) + (64+32) + (64+32) + (64+64) + 3 * (64+128)) = 8192 per layer.
N_LORA = 2 * 8192


def test_param_counts_by_hand():
    c = param_counts(TINY)
    assert (c.layers, c.head, c.embedding, c.norms) == (73728, 64000, 64000, 5 * 64)
    assert lora_params(TINY, 8) == N_LORA
    assert lora_params(TINY, 8, ("q_proj", "v_proj")) == 2 * 8 * (128 + 96)


def test_full_finetune_is_palm_6n_plus_attention():
    assert flops_per_token(TINY, 32) == 6 * (N_LAYERS + N_HEAD) + ATTN == 875520


def test_lora_drops_frozen_weight_gradients():
    assert flops_per_token(TINY, 32, lora_params=N_LORA) == 4 * (N_LAYERS + N_HEAD) + 6 * N_LORA + ATTN == 698368
    # Tail loss keeping 2 of 32 positions' logits: the LM head costs 1/16 per position.
    assert flops_per_token(TINY, 32, lora_params=N_LORA, logits_fraction=2 / 32) == \
        4 * (N_LAYERS + N_HEAD / 16) + 6 * N_LORA + ATTN == 458368
    assert flops_per_token(TINY, 32, lora_params=0) == 4 * (N_LAYERS + N_HEAD) + ATTN
    with pytest.raises(ValueError):
        flops_per_token(TINY, 32, logits_fraction=1.5)


def test_counts_match_a_real_llama_and_peft_model():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**vars(TINY), tie_word_embeddings=True, max_position_embeddings=64)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    c = param_counts(cfg)
    assert sum(p.numel() for p in model.parameters()) == c.layers + c.embedding + c.norms  # head tied
    peft = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    assert sum(p.numel() for p in peft.parameters() if p.requires_grad) == lora_params(cfg, 8)


def test_peak_flops_table_and_names():
    assert peak_flops("NVIDIA H100 80GB HBM3") == PEAK_BF16_FLOPS["H100 SXM"] == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == peak_flops("NVIDIA A100 80GB PCIe") == 312e12
    assert peak_flops("NVIDIA A10") == 125e12 and peak_flops("NVIDIA L4") == 121e12
    assert peak_flops("NVIDIA L40S") is None and peak_flops("NVIDIA H100 NVL") is None and peak_flops("cpu") is None
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)


@pytest.mark.parametrize("objective,reference,adapter", [("sft", "adapter", None), ("dpo", "adapter", None),
                                                        ("dpo", "adapter", "runs/sft/adapter"),
                                                        ("dpo", "precomputed", None), ("simpo", "adapter", None)])
def test_train_mfu_counts_the_in_step_dpo_reference_forward(objective, reference, adapter):
    """``train/mfu``'s FLOPs (:func:`scale.training.metrics.model_flops`) of 2 rows x T = 32, tail 8: the LoRA step
    ``4 (N + f N_head) + 6 N_lora + 12 L T d``, plus the reference's forward ``2 (N + f N_head) + 4 L T d`` (+ ``2
    N_lora`` from a starting adapter) when DPO runs it in the step; none for precomputed references or SimPO."""
    from scale.config.load import load_config
    from scale.training.metrics import model_flops

    cfg = load_config(None, [f"loss.objective={objective}", f"loss.reference={reference}"]
                      + ([f"model.adapter={adapter}"] if adapter else []))
    f = 8 / 32
    step = 4 * (N_LAYERS + f * N_HEAD) + 6 * N_LORA + ATTN
    forward = 2 * (N_LAYERS + f * N_HEAD) + ATTN // 3 + (2 * N_LORA if adapter else 0)
    want = 2 * 32 * (step + (forward if objective == "dpo" and reference == "adapter" else 0))
    assert model_flops(cfg, TINY, N_LORA)(2, 32, 8) == pytest.approx(want, rel=1e-12)
