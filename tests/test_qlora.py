"""QLoRA on CPU: trains, and its LoRA gradients equal those of an fp32 model on the dequantized weights.

bitsandbytes repacks 4-bit weights for CPU inference after an eval-mode forward and then computes without
autograd (see ``scale.modeling.build.disable_cpu_inference_packing``); these tests run an eval pass first so that
trap would show.
"""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from scale.config.schema import LoraConfig, ModelConfig
from scale.modeling.build import build_model  # noqa: E402
from tests.conftest import tiny_cfg  # noqa: E402

LORA = LoraConfig(r=4, alpha=8.0, dropout=0.0)


def _quantized_and_reference(gradient_checkpointing: bool):
    q = build_model(ModelConfig(name_or_path="tiny-llama", quantize_4bit=True, gradient_checkpointing=gradient_checkpointing),
                    LORA, vocab_size=300, seed=0)
    ref = build_model(ModelConfig(name_or_path="tiny-llama", gradient_checkpointing=gradient_checkpointing), LORA,
                      vocab_size=300, seed=0)
    dequant = {name: bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
               for name, m in q.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(dequant) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    q_params = dict(q.named_parameters())
    with torch.no_grad():
        for name, m in ref.named_modules():
            if name in dequant:
                m.weight.copy_(dequant[name])
        for name, p in ref.named_parameters():
            if "lora_" in name or not name.endswith("base_layer.weight"):
                p.copy_(q_params[name].float())
    return q, ref


def _grads(model, ids):
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))       # an eval pass, as at step 0
    model.train()
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=3).logits
    out.float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_qlora_lora_grads_match_dequantized_reference(gradient_checkpointing):
    q, ref = _quantized_and_reference(gradient_checkpointing)
    ids = torch.randint(3, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    gq, gr = _grads(q, ids), _grads(ref, ids)
    assert gq.keys() == gr.keys() and len(gq) == 28
    nonzero = [n for n in gr if gr[n].abs().max() > 0]
    assert len(nonzero) == 14   # every lora_B (lora_A grads are 0 while B is 0 at init)
    # The same maths on the same (dequantized) weights in other kernels: two fp32 paths (tests/bounds.py), each
    # gradient tensor relative to its largest element.
    from tests.bounds import fp32_paths_rel

    cfg = ref.config if hasattr(ref, "config") else ref.get_base_model().config
    rel = fp32_paths_rel(cfg.vocab_size, cfg.intermediate_size)
    for n in nonzero:
        assert (gq[n] - gr[n]).abs().max() <= rel * gr[n].abs().max(), n
    assert all(torch.equal(gq[n], gr[n]) for n in gq if n not in nonzero)   # lora_A: exactly 0 on both


def test_qlora_job_trains_on_cpu(tmp_path):
    from safetensors.torch import load_file

    from scale.train import run
    from scale.training.metrics import read_jsonl

    from tests.launching import assert_invariants

    # tiny_cpu.yaml checkpoints every layer: checkpointed QLoRA on one device (tests/test_modes.py's other modes)
    final = run(tiny_cfg(tmp_path, "model.quantize_4bit=true", "train.max_steps=4", "optim.lr=5e-3",
                         "train.check_invariants=true"))
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    # base bit-identical, all 14 lora_B moved, weights whole on the one rank
    assert_invariants([r for r in metrics if "check/base_unchanged" in r], "single", step=4)
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert len(lora_b) == 14 and all(v.abs().max() > 0 for v in lora_b)
    assert final["eval/examples"] == 32
