"""``scale-plan`` on mixture-of-experts models: the counts against a real tiny Qwen3-MoE (saved tensors, live bytes of
an optimizer step), total vs active parameters, the FLOPs a token costs, and the shipped Qwen3-30B-A3B shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scale.config.load import load_config
from scale.modeling.moe import moe_layout
from scale.modeling.moe_counts import active_counts, model_shape
from scale.planner import activations as A
from scale.planner import census as C
from scale.planner import plan as P
from scale.utils.compat import peft_adapts_parameters
from scale.utils.flops import flops_per_token
from scale.utils.flops import model_shape as dense_shape
from tests.conftest import ROOT, TINY_YAML
from tests.test_plan import live_step_peak, real_saved_bytes

# LoRA on fused experts needs peft's target_parameters (peft 0.17); the lowest-versions tier (peft 0.15) runs
# tests/test_compat.py's refusal test instead.
pytestmark = pytest.mark.skipif(not peft_adapts_parameters(), reason="peft without target_parameters (< 0.17)")


E, K, H, I = 8, 2, 64, 32  # experts, per token, hidden, expert width
V = 49152


def moe_dir(tmp: Path) -> Path:
    """A tiny Qwen3-MoE (2 layers, 8 experts, top-2) saved with random weights: a directory the harness loads."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=H, intermediate_size=128, moe_intermediate_size=I,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=E,
                         num_experts_per_tok=K, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
                         use_cache=False)
    path = tmp / "tiny-qwen3-moe"
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


def planned(tmp: Path, *overrides: str):
    cfg = load_config(TINY_YAML, ["log.trackers=[]", "train.gradient_accumulation_steps=1",
                                  f"model.name_or_path={moe_dir(tmp)}", "model.tokenizer=smollm2-135m", *overrides])
    hf = C.load_model_config(cfg.model)
    return cfg, hf, C.census(cfg, C.build_meta_model(cfg, hf))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_planned_moe_activations_within_10_percent_of_saved_tensor_hooks(checkpointing, tmp_path):
    """The fake-tensor count runs (it stopped with "Expected inputs of BF16 type" from grouped_mm's fake kernel) and
    lands within 10% of what autograd saves in a real forward, on both expert paths: split (the routed pairs'
    activations) and peft (the sorted pairs ``[n k, H]`` and, per MoE layer, the expert stack ``W + B A`` its
    parameter LoRA computes)."""
    from scale.modeling.build import build_model

    predicted = {}
    for impl in ("split", "peft"):
        cfg, hf, params = planned(tmp_path, "train.micro_batch_size=4", "data.max_length=32",
                                  f"lora.expert_impl={impl}",
                                  f"model.gradient_checkpointing={str(checkpointing).lower()}")
        predicted[impl] = A.count_activations(cfg, C.build_meta_model(cfg, hf), params).total
        model = build_model(cfg.model, cfg.lora, V, cfg.train.seed)
        real = real_saved_bytes(model, cfg)
        assert abs(predicted[impl] / real - 1) < 0.10, (impl, predicted, real)
    if not checkpointing:  # peft keeps each MoE layer's W + B A stacks, gate_up [E, 2I, H] and down [E, H, I], fp32
        assert predicted["peft"] - predicted["split"] > 2 * 4 * E * 3 * I * H


def test_planned_moe_single_device_peak_within_10_percent_of_live_tensor_bytes(tmp_path):
    from scale.modeling.build import build_model

    B, T = 4, 32
    cfg, _hf, _ = planned(tmp_path, f"train.micro_batch_size={B}", f"data.max_length={T}",
                          "model.gradient_checkpointing=true")
    predicted = P.make_plan(cfg, 1).ranks[0]
    peak = live_step_peak(cfg, build_model(cfg.model, cfg.lora, V, 0), B, T)
    assert abs(predicted.allocated / peak - 1) < 0.10, (predicted, peak)


def test_active_parameters_and_flops_count_k_of_e_experts(tmp_path):
    """Hand count on the real model: a token uses the attention, embeddings, norms, routers and 2 of the 8 experts."""
    from scale.modeling.build import build_model

    cfg, _hf, _ = planned(tmp_path)
    model = build_model(cfg.model, cfg.lora, V, 0)
    layout = moe_layout(model)
    named = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in named.items() if n.endswith(("experts.base_layer.base_layer.gate_up_proj",
                                                                     "experts.base_layer.base_layer.down_proj")))
    assert experts == 2 * E * (2 * I * H + H * I)
    expert_lora = sum(p.numel() for n, p in named.items() if ".mlp.experts." in n and ".lora_" in n)
    r = cfg.lora.r
    assert expert_lora == 2 * (r * E * H + 2 * I * r * E + r * E * I + H * r * E)  # lora_A [rE, in], B [out, rE]
    total = sum(p.numel() for p in model.parameters())
    counts = active_counts(model, layout)
    assert (counts.total, counts.experts, counts.routers, counts.expert_lora) == (total, experts, 2 * E * H,
                                                                                  expert_lora)
    assert counts.active == total - (experts + expert_lora) * (E - K) // E
    shape, dense = model_shape(model), dense_shape(model)
    assert shape.layers == dense.layers + experts * K // E + 2 * E * H  # + the active experts and the routers
    assert shape.inactive_lora == expert_lora * (E - K) // E
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # 4 x frozen matmul elements + 6 x the adapter elements a token uses + attention (flops.py's count)
    expected = 4 * (shape.layers + shape.head) + 6 * (trainable - shape.inactive_lora) + 12 * 2 * 64 * 4 * 16
    assert flops_per_token(shape, 64, lora_params=trainable) == expected


@pytest.mark.slow
def test_qwen3_30b_a3b_plan_counts_its_published_sizes():
    """configs/models/qwen3-30b-a3b.json (Qwen/Qwen3-30B-A3B's config.json): 30.5B parameters, 3.3B activated
    (its model card); the plan says both and ZeRO-3 offload is what fits 2 x 24 GiB."""
    path = ROOT / "configs" / "models" / "qwen3-30b-a3b.json"
    hf = json.loads(path.read_text())
    cfg = load_config(TINY_YAML, ["log.trackers=[]", f"model.name_or_path={path}", "model.dtype=bfloat16",
                                  "train.mixed_precision=bf16", "model.quantize_4bit=true",
                                  "model.bnb_4bit_compute_dtype=bfloat16", "model.bnb_4bit_quant_storage=bfloat16",
                                  "model.gradient_checkpointing=true", "train.micro_batch_size=8",
                                  "data.max_length=96", "loss.threshold=2"])
    plan = P.make_plan(cfg, 2, gpu_mem_gib=24)
    base = plan.parameters - plan.trainable_parameters
    d, L, e, i = hf["hidden_size"], hf["num_hidden_layers"], hf["num_experts"], hf["moe_intermediate_size"]
    attention = d * 32 * 128 * 2 + 2 * d * 4 * 128 + 2 * 128  # q, o; k, v; q_norm, k_norm
    per_layer = attention + e * 3 * d * i + e * d + 2 * d    # experts, router, two norms
    assert base == L * per_layer + 2 * hf["vocab_size"] * d + d == 30_532_122_624
    k, r = hf["num_experts_per_tok"], cfg.lora.r
    base_active = L * (attention + k * 3 * d * i + e * d + 2 * d) + 2 * hf["vocab_size"] * d + d
    assert 3.3e9 < base_active < 3.4e9  # "3.3B activated"
    expert_lora = L * r * e * (2 * d + 3 * i)  # gate_up: A [r e, d], B [2i, r e]; down: A [r e, i], B [d, r e]
    adapter_active = plan.trainable_parameters - expert_lora * (e - k) // e
    # the base model's counts, as its model card gives them, then the adapter's
    assert plan.experts.startswith(
        f"mixture of experts: 128 routed experts, top-8, in 48 layers: 30,532,122,624 base parameters, "
        f"{base_active:,} active per token ({base_active / base:.1%}); the LoRA adapter adds "
        f"{plan.trainable_parameters:,} ({adapter_active:,} active); training FLOPs per token ")
    assert plan.recommended == "zero3_offload"
    # docs/models.md quotes the line of a LoRA r=16 plan of 4 x 2,048 tokens: the counts before the FLOPs do not
    # depend on the tokens, and the adapter's are r times a rank-1 adapter's
    quoted = next(line for line in (ROOT / "docs" / "models.md").read_text().splitlines()
                  if line.startswith("mixture of experts: 128 routed experts"))
    ours, at_16 = f"{plan.trainable_parameters:,} ({adapter_active:,} active)", \
        f"{plan.trainable_parameters * 16 // r:,} ({adapter_active * 16 // r:,} active)"
    assert quoted.split("; training FLOPs")[0] == plan.experts.split("; training FLOPs")[0].replace(ours, at_16)


def test_the_docs_size_of_qwen3_30b_a3b_experts_and_the_plan_help():
    """docs/models.md: Qwen3-30B-A3B's bf16 experts are 48 x 128 x 3 x 2048 x 768 x 2 bytes = 54.00 GiB; scale-plan
    --help says a mixture-of-experts plan counts its activations (it once said the count stopped in fp32)."""
    import contextlib
    import io

    from scale.plan import main as plan_command

    hf = json.loads((ROOT / "configs" / "models" / "qwen3-30b-a3b.json").read_text())
    experts = (hf["num_hidden_layers"] * hf["num_experts"] * 3 * hf["hidden_size"] * hf["moe_intermediate_size"]
               * 2)
    assert (hf["num_hidden_layers"], hf["num_experts"], hf["hidden_size"], hf["moe_intermediate_size"]) == (
        48, 128, 2048, 768)
    docs = " ".join((ROOT / "docs" / "models.md").read_text().split())
    assert f"the bf16 experts alone are {experts / 2**30:.2f} GiB" in docs and experts == 54 * 2**30
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        plan_command(["--help"])
    text = " ".join(out.getvalue().split())
    assert ("Mixture-of-experts models (Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss) plan their parameters exactly and "
            "count their activations in any dtype") in text
    assert "refuses to run" not in text and "cannot know" not in text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_moe_layer_peak_equals_the_live_bytes_of_the_run_model_on_both_paths(dtype, tmp_path):
    """scale-plan's count of one MoE layer's forward + backward (``scale.planner.moe.count_moe_layer``, fake
    tensors) against the live tensor bytes of the same layer of the model the run builds (``build_model``: float32
    adapters on a bf16 base), on the same micro-batch, on both expert paths: the same tensors are allocated, so
    within the 5% the planner promises (equal here); peft's path, which adds W + B A and its gradient, more."""
    from scale.modeling.build import build_model
    from scale.modeling.moe_lora import on_path
    from scale.planner.moe import count_moe_layer
    from tests.live_bytes import LiveBytes

    B, T = 2, 24
    cfg, hf, _ = planned(tmp_path, f"train.micro_batch_size={B}", f"data.max_length={T}", f"model.dtype={dtype}",
                              "model.gradient_checkpointing=false")
    meta = C.build_meta_model(cfg, hf)
    counted = count_moe_layer(cfg, meta, C.census(cfg, meta))
    model = build_model(cfg.model, cfg.lora, V, cfg.train.seed)
    block = model.get_submodule("base_model.model.model.layers.0.mlp")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, H, generator=gen).to(getattr(torch, dtype)).requires_grad_()
    g = torch.randn(B, T, H, generator=gen)
    for impl in ("split", "peft"):
        with on_path(block.experts, impl):
            live = LiveBytes(*model.parameters(), *model.buffers(), x, g)
            with live:  # the block's output dropped before backward, as the residual add drops it
                (block(x).float() * g).sum().backward()
            x.grad = None
            model.zero_grad(set_to_none=True)
        assert abs(counted[impl] / (live.peak - live.before) - 1) <= 0.05, (impl, counted, live.peak - live.before)
    assert counted["peft"] > counted["split"]
