"""A mixture-of-experts model under DDP, ZeRO-2, ZeRO-3 and FSDP2 on 2 CPU processes: experts that receive no token
(on a rank, in a micro-batch, or ever) neither stop the run with an unused-parameter error nor hang it, and the run
equals one device.
"""

from __future__ import annotations

import pytest
import torch

from tests.launching import modes, read_run, rel_dev, run_in_process, run_mode, weight_dev

TOL = 1e-5  # the launch tests' parity bound (tests/test_distributed.py): fp32 sums over 2 ranks in another order
E, K, H = 8, 2, 32
IDLE = (4, 5, 6, 7)


def routed_dir(path):
    """A tiny Qwen3-MoE whose routers send every token to one of experts {0, 1} and one of {2, 3}, never to 4-7.

    Each MoE input is the post-attention RMSNorm's output; its weight is zeroed but for coordinates 0 and 1, so the
    router sees ``x = (x0, x1, 0, ...)``; router rows ``+-8 e_0`` (experts 0, 1) and ``+-8 e_1`` (experts 2, 3) give
    logits ``+-8 x0``, ``+-8 x1`` and 0 for experts 4-7: the top 2 are the two positive ones (x0, x1 != 0).
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=H, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=E,
                         num_experts_per_tok=K, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            gamma = torch.zeros(H)
            gamma[:2] = 1.0
            layer.post_attention_layernorm.weight.copy_(gamma)
            w = torch.zeros(E, H)
            w[0, 0], w[1, 0], w[2, 1], w[3, 1] = 8.0, -8.0, 8.0, -8.0
            layer.mlp.gate.weight.copy_(w)
    model.save_pretrained(path)
    return path


EXTRA = ["model.tokenizer=smollm2-135m", "model.gradient_checkpointing=true"]
MODES = ["ddp 2x(2,2)"]
if __import__("importlib").util.find_spec("deepspeed") is not None:
    MODES += ["zero2 2x(2,2)", "zero3 2x(2,2)"]  # ZeRO-3 loads the directory under zero.Init
MODES += ["fsdp2 2x(2,2)"]


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """The model directory and its one-device run (tests/launching.py's single 1x(8,1), in this process)."""
    root = tmp_path_factory.mktemp("moe")
    model = routed_dir(root / "moe")
    _, single = modes()["single 1x(8,1)"]
    return model, run_in_process(single + EXTRA + [f"model.name_or_path={model}"], root / "single"), root / "single"


@pytest.mark.launch
@pytest.mark.parametrize("mode", MODES)
def test_idle_experts_train_as_on_one_device(mode, routed, tmp_path):
    """Every rank computes every expert's W + B A (transformers' grouped kernel reads the whole stack), so no rank
    skips a parameter another one gathers or reduces: no unused-parameter error (DDP), no hang (ZeRO-3, FSDP2)."""
    model, reference, single_dir = routed
    cmds, overrides = modes()[mode]
    got = run_mode(cmds, overrides + EXTRA + [f"model.name_or_path={model}"], tmp_path / "run", timeout=900)
    assert got["steps"] == reference["steps"] == [1, 2, 3, 4, 5, 6]
    assert rel_dev(reference["loss"], got["loss"]) < TOL
    assert rel_dev(reference["grad_norm"], got["grad_norm"]) < TOL
    assert weight_dev(reference["weights"], got["weights"]) < TOL
    experts = {k: v for k, v in got["weights"].items() if ".mlp.experts" in k and "lora_B" in k}
    assert len(experts) == 4  # gate_up_proj and down_proj in 2 layers
    for name, b in experts.items():  # lora_B [out, r * E]: column j * E + e is expert e's
        per_expert = b.reshape(b.shape[0], -1, E).abs().amax(dim=(0, 1))
        assert all(per_expert[e] == 0 for e in IDLE), (name, per_expert)      # never routed: never trained
        assert all(per_expert[e] > 0 for e in range(4)), (name, per_expert)   # routed: trained
    import json

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    load = [r for r in rows if "train/expert_load/idle_experts" in r]
    assert len(load) == 6
    for r in load:  # summed over both ranks: experts 4-7 idle in both layers, 0-3 share every token
        assert all(r[f"train/expert_load/tokens/e{e}"] == 0 for e in IDLE)
        assert r["train/expert_load/idle_experts"] == 2 * len(IDLE)
        assert sum(r[f"train/expert_load/tokens/e{e}"] for e in range(4)) > 0
    single_load = [r for r in map(json.loads, (single_dir / "metrics.jsonl").read_text().splitlines())
                   if "train/expert_load/idle_experts" in r]
    for a, b in zip(single_load, load):  # the same tokens routed to the same experts, counted on 1 or 2 ranks
        assert {k: v for k, v in a.items() if k.startswith("train/expert_load/tokens")} == \
            {k: v for k, v in b.items() if k.startswith("train/expert_load/tokens")}
