"""A mixture-of-experts model under DDP, ZeRO-2, ZeRO-3 and FSDP2 on 2 CPU processes: experts that receive no token
(on a rank, in a micro-batch, or ever) neither stop the run with an unused-parameter error nor hang it, and the run
equals one device.
"""

from __future__ import annotations

import json

import pytest

from scale.utils.compat import peft_adapts_parameters
from tests.launching import modes, rel_dev, run_in_process, run_mode, save_tiny_moe_directory, weight_dev

# LoRA on fused experts needs peft's target_parameters (peft 0.17); the lowest-versions tier (peft 0.15) runs
# tests/test_compat.py's refusal test instead.
pytestmark = [pytest.mark.skipif(not peft_adapts_parameters(), reason="peft without target_parameters (< 0.17)")]

TOL = 1e-5  # the launch tests' parity bound (tests/test_distributed.py): fp32 sums over 2 ranks in another order
E = 8
IDLE = (4, 5, 6, 7)  # experts the routers of save_tiny_moe_directory's model never choose


EXTRA = ["model.tokenizer=smollm2-135m", "model.gradient_checkpointing=true"]
MODES = ["ddp 2x(2,2)"]
if __import__("importlib").util.find_spec("deepspeed") is not None:
    MODES += ["zero2 2x(2,2)", "zero3 2x(2,2)"]  # ZeRO-3 loads the directory under zero.Init
MODES += ["fsdp2 2x(2,2)"]


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """The model directory and its one-device run (tests/launching.py's single 1x(8,1), in this process)."""
    root = tmp_path_factory.mktemp("moe")
    model = save_tiny_moe_directory(root / "moe")
    _, single = modes()["single 1x(8,1)"]
    return model, run_in_process(single + EXTRA + [f"model.name_or_path={model}"], root / "single"), root / "single"


@pytest.mark.launch
@pytest.mark.parametrize("mode", MODES)
def test_idle_experts_train_as_on_one_device(mode, routed, tmp_path):
    """The split expert LoRA (the default, ``lora.expert_impl`` null): every rank runs every expert's grouped products
    (the whole stack and every LoRA factor are read, an idle expert's rows are none), so no rank skips a parameter
    another one gathers or reduces: no unused-parameter error (DDP), no hang (ZeRO-3, FSDP2); the start-up line says
    what each rank gathers where the weights are sharded."""
    model, reference, single_dir = routed
    cmds, overrides = modes()[mode]
    got = run_mode(cmds, overrides + EXTRA + [f"model.name_or_path={model}"], tmp_path / "run", timeout=900)
    assert "experts' LoRA split: x W_e + alpha/r (x A_e) B_e on the tokens routed to each expert" in got["output"]
    sharded = {"zero3": "ZeRO-3", "fsdp2": "FSDP2"}.get(mode.split()[0])
    assert (f"{sharded}: every rank gathers each MoE layer's whole expert stack" in got["output"]) == bool(sharded)
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
